"""Embedding rows <-> bytes for the bus (float16 by default: the rows are small and robust to it)."""
from __future__ import annotations

import numpy as np
import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def rows_to_bytes(rows: torch.Tensor, dtype: str = "float16") -> bytes:
    t = rows.detach().to(DTYPES[dtype]).contiguous().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def rows_from_bytes(raw: bytes, dtype: str, num_tokens: int, hidden_size: int) -> torch.Tensor:
    """[num_tokens, hidden_size] float32 rows; ValueError when the sizes disagree."""
    width = 4 if dtype == "float32" else 2
    if len(raw) != num_tokens * hidden_size * width or dtype not in DTYPES:
        raise ValueError(f"{len(raw)} bytes are not {num_tokens}x{hidden_size} {dtype} rows")
    np_dtype = {"float16": np.float16, "float32": np.float32, "bfloat16": np.int16}[dtype]
    t = torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy()).view(num_tokens, hidden_size)
    return (t.view(torch.bfloat16) if dtype == "bfloat16" else t).float()
