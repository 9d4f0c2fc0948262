"""The Platform protocol: what the engine, the models and the worker ask of a device."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moebus.engine.attention import AttentionMetadata
    from moebus.engine.lm_head import LMHead
    from moebus.platforms.format_choice import FormatChoice

# A model's batch-1 decode step: (model, input_ids, positions, meta, kv_caches) -> the hidden state
# [1, hidden], or None where the module path must run (the model's forward calls it first).
DecodeStep = Callable[..., "torch.Tensor | None"]


class Platform(Protocol):
    device: str  # as the engine config names it: "cpu", "cuda", "cuda:1"
    # Steps whose rows all decode greedily on raw logits skip the sampler and take their tokens from
    # the LM head's greedy path (engine/model_runner.py), outside deterministic mode.
    raw_argmax: bool

    def resolve_dtype(self, requested: str) -> str:
        """The compute dtype for `requested` ("auto" or explicit), logged (dtype_choice.py)."""
        ...

    def resolve_format(self, path: Path, requested: str, dtype: str) -> FormatChoice:
        """The weight format for `requested` ("auto", "dense", "gguf"), logged (format_choice.py)."""
        ...

    def tune_malloc(self) -> bool:
        """Process-wide allocator settings for the engine's transient tensors; False: none applied."""
        ...

    def prepare_model(self, model: nn.Module, batch_invariant: bool) -> None:
        """Swap a loaded model's layers for this device's faster equivalents (same results up to
        summation order), once, before its runner binds the head."""
        ...

    def decode_fast_path(self, model: nn.Module) -> DecodeStep | None:
        """The model's batch-1 decode step on this device, or None: the module path only."""
        ...

    def panels_wanted(self, dtype: torch.dtype) -> bool:
        """Whether `dtype` GEMMs take kernels/panel_linear.py here (a row's result never depends on
        the batch)."""
        ...

    def float_head(self, head: nn.Module) -> bool:
        """Whether `head`'s own forward gives its float32 logits (engine/lm_head.float_logits)."""
        ...

    def bind_lm_head(self, head: nn.Module | None, embed: nn.Module, weight: torch.Tensor) -> LMHead:
        """The LM head bound once (bias-free, not quantized: engine/lm_head.LMHead.of handles those);
        head None: tied to `embed`, whose weight is `weight`."""
        ...

    # Per-call kernel choices, asked through `platforms.of(tensor)` (one lookup by device type).
    quantized_experts: bool  # GGUF-quantized MoE experts run here (models/quant_experts.py)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, seqs: list[int], scale: float, sliding_window: int | None,
                          sinks: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor | None:
        """The prompt chunks of sequences `seqs` over the paged cache in one kernel call, into out;
        None: not here (the engine's per-sequence path runs)."""
        ...

    def top_p_floor(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    kth: torch.Tensor) -> torch.Tensor | None:
        """Each row's top-p floor (kernels/sample.py:top_p_floor_ref) without sorting the rows;
        None: not here (the sampler's top-k widening path runs)."""
        ...
