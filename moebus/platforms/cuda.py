"""CudaPlatform: every device but the CPU, on the Triton kernels and torch (no CPU fast path)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moebus.engine.lm_head import LMHead, float_logits
from moebus.kernels.lm_head_argmax import lm_head_argmax
from moebus.platforms.dtype_choice import resolve_dtype
from moebus.platforms.format_choice import FormatChoice, resolve_format

if TYPE_CHECKING:
    from moebus.engine.attention import AttentionMetadata


@dataclass(frozen=True)
class CudaPlatform:
    device: str = "cuda"
    raw_argmax: bool = False  # raw-argmax steps were measured on CPU only: GPUs keep the sampler path
    quantized_experts: bool = False  # no GPU kernel for GGUF-quantized experts: serve them dense

    def resolve_dtype(self, requested: str) -> str:
        return resolve_dtype(requested, self.device)

    def resolve_format(self, path: Path, requested: str, dtype: str) -> FormatChoice:
        return resolve_format(path, requested, dtype, self.device)

    def tune_malloc(self) -> bool:
        return False

    def prepare_model(self, model: nn.Module, batch_invariant: bool) -> None:
        pass

    def decode_fast_path(self, model: nn.Module) -> None:
        return None

    def panels_wanted(self, dtype: torch.dtype) -> bool:
        return False

    def float_head(self, head: nn.Module) -> bool:
        return False

    def bind_lm_head(self, head: nn.Module | None, embed: nn.Module, weight: torch.Tensor) -> LMHead:
        # the Triton head+argmax (float32 sums) where it launches
        return LMHead(lambda x: float_logits(head, embed, x), lambda x: lm_head_argmax(x, weight))

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, seqs: list[int], scale: float, sliding_window: int | None,
                          sinks: torch.Tensor | None, out: torch.Tensor) -> None:
        return None

    def top_p_floor(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    kth: torch.Tensor) -> None:
        return None
