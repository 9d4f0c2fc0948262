"""Converted-GGUF cache: parsing a GGUF costs seconds per process, so the first load writes an
HF-layout copy (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that later
loads (every service process) read in well under a second. The GGUF blocks of the quantized
tensors are cached beside it on first use (gguf_blocks.safetensors), for weight_format "gguf"."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moebus.engine.loader.gguf_file import GGUFCheckpoint
from moebus.text.gguf import converted_path
from moebus.text.tokenizer import tokenizer_from_gguf


def converted_dir(gguf_path: str | Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """HF-layout directory for this GGUF, converting it on first use (atomic rename, race-safe);
    progress(tensors done, total) is called while converting."""
    path = Path(gguf_path)
    out = converted_path(path)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    ckpt = GGUFCheckpoint.open(path)
    tok = tokenizer_from_gguf(ckpt.metadata)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    save_file(ckpt.state_dict(progress=progress), str(tmp / "model.safetensors"))
    tok.backend.save(str(tmp / "tokenizer.json"))
    cfg = ckpt.hf_config()
    cfg["eos_token_id"] = tok.eos_token_ids
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos, "bos_token_id": tok.bos_token_id}))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


# In a subfolder: checkpoint readers take every *.safetensors of the converted directory as weights.
BLOCKS_FILE = Path("gguf_blocks") / "blocks-v4.safetensors"  # v2: the experts' blocks too; v3: Q4_K; v4: Q6_K/Q5_K


def quantized_blocks(gguf_path: str | Path) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (GGUF type, uint8 blocks [rows, bytes]) of this GGUF's Q4_0/Q4_1/Q8_0 tensors
    (Q4_K as Q4_1, Q6_K/Q5_K as Q8_0: loader/kquants.py; GGUFCheckpoint.quantized_blocks), cached in its converted
    directory; the types ride in the safetensors metadata."""
    out_dir = converted_dir(gguf_path)
    path = out_dir / BLOCKS_FILE
    if not path.exists():
        blocks = GGUFCheckpoint.open(gguf_path).quantized_blocks()
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file({k: v for k, (_, v) in blocks.items()}, tmp, metadata={k: t for k, (t, _) in blocks.items()})
        os.replace(tmp, path)  # atomic: a concurrent loader sees no file or a whole one
    with safe_open(str(path), "pt") as f:
        types = f.metadata() or {}
        return {k: (types[k], f.get_tensor(k)) for k in f.keys()}
