"""CpuPlatform: the choices the engine, the models and the worker make on the CPU."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moebus.engine.lm_head import LMHead
from moebus.kernels.prefill_attention import prefill_attention_cpu
from moebus.kernels.sample import top_p_floor
from moebus.platforms.cpu import lm_head, packed_linear
from moebus.platforms.cpu.decode_fast_path import DecodeFastPath
from moebus.platforms.cpu.malloc import tune_malloc
from moebus.platforms.cpu.moe_decode import moe_decode_fast_path
from moebus.platforms.dtype_choice import resolve_dtype
from moebus.platforms.format_choice import FormatChoice, resolve_format

if TYPE_CHECKING:
    from moebus.engine.attention import AttentionMetadata


@dataclass(frozen=True)
class CpuPlatform:
    device: str = "cpu"
    # Raw-argmax steps take their tokens from a fused head+argmax kernel (or the panel kernel's
    # logits), no sampler: measured on CPU (GPUs keep the sampler path).
    raw_argmax: bool = True
    quantized_experts: bool = True  # csrc/qmoe_cpu.c

    def resolve_dtype(self, requested: str) -> str:
        return resolve_dtype(requested, self.device)

    def resolve_format(self, path: Path, requested: str, dtype: str) -> FormatChoice:
        return resolve_format(path, requested, dtype, self.device)

    def tune_malloc(self) -> bool:
        return tune_malloc()  # glibc's thresholds (malloc.py)

    def prepare_model(self, model: nn.Module, batch_invariant: bool) -> None:
        if not batch_invariant:  # deterministic mode keeps its own batch-invariant layers
            packed_linear.pack_linears(model)  # fp32/bf16 GEMMs on prepacked oneDNN weights

    def decode_fast_path(self, model: nn.Module) -> DecodeFastPath | None:
        """By the model's `decode_stack` ("llama", "moe"): its layers in kernels/decode_stack.py's
        one C call (decode_fast_path.py, moe_decode.py say when it applies)."""
        kind = getattr(model, "decode_stack", None)
        if kind == "llama":
            return DecodeFastPath()
        if kind == "moe":
            return moe_decode_fast_path()
        return None

    def panels_wanted(self, dtype: torch.dtype) -> bool:
        return packed_linear.panels_wanted(dtype)

    def float_head(self, head: nn.Module) -> bool:
        # a prepacked float32 head: oneDNN's packed GEMM
        return isinstance(head, packed_linear.PackedLinear) and head.weight.dtype == torch.float32

    def bind_lm_head(self, head: nn.Module | None, embed: nn.Module, weight: torch.Tensor) -> LMHead:
        return lm_head.bind(head, weight)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, seqs: list[int], scale: float, sliding_window: int | None,
                          sinks: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor | None:
        # One C call over the paged cache instead of an SDPA call per sequence: K/V packed once per
        # step, no per-sequence dispatch. Its rows do not depend on the batch (deterministic mode too).
        qsl = meta.query_start_loc
        return prefill_attention_cpu(q, k_cache, v_cache, meta.block_tables[seqs], [qsl[b] for b in seqs],
                                     [qsl[b + 1] - qsl[b] for b in seqs], [meta.seq_lens[b] for b in seqs],
                                     scale, sliding_window, sinks, out)

    def top_p_floor(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    kth: torch.Tensor) -> torch.Tensor | None:
        return top_p_floor(x, temperature, top_p, kth)  # csrc/sample_cpu.c: a histogram of the mass
