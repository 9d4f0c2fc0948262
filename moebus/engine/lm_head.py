"""A model's LM head as the engine reads it: hidden rows -> float32 logits, or greedy token ids.

One rule on every path (the sampler, logprobs, speculative verification, the greedy head, the
quantized head, deterministic mode): the logits are float32 sums of the storage-dtype products,
never rounded to the storage dtype first, and greedy takes the first maximum of each row (the
lowest token id among equal float32 logits; a row holding a NaN gives its first NaN), torch's
`max(dim=1).indices`. Rounding bf16 logits broke near-ties: bf16 steps by 0.125 at a logit of 25,
SmolLM2's first answer token to "What is the capital of France?" leads by 0.08 in float32, and
the rounded tie went to the lower token id (the answer began "L'Étoile" instead of "The capital").

Paths differ only in summation order. Where the panel kernel is taken (AVX-512 without AMX) it
serves every call, so a row's logits never depend on the rest of the batch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moebus.engine.cpu_linear import PackedLinear, QuantLinear, panels_wanted
from moebus.kernels.argmax import row_argmax
from moebus.kernels.lm_head_argmax import lm_head_argmax, lm_head_logits, pack_panels
from moebus.kernels.panel_linear import PanelLinear, panel_linear_applies


def float_logits(head: nn.Module | None, embed: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A model's compute_logits: hidden [M, H] -> float32 [M, V] by its head (None: tied to
    `embed`'s weight). For tests and tools: a bf16 head without a PackedLinear's panels is packed
    again at each call; the engine (steps, MTP drafts) reads the LMHead its runner binds once."""
    if isinstance(head, QuantLinear):
        return head(hidden.float())
    if isinstance(head, PackedLinear) and head.weight.dtype == torch.float32:
        return head(hidden)
    weight = embed.weight if head is None else head.weight
    out = lm_head_logits(hidden, weight, getattr(head, "panels", None))
    return out if head is None or head.bias is None else out + head.bias.float()


class LMHead:
    """The head of one model bound once: what does not depend on the input (the packed panels,
    the kernels) is prepared here. `logits` for the sampler, `greedy` for raw-argmax steps."""

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor],
                 greedy: Callable[[torch.Tensor], torch.Tensor], panels: torch.Tensor | None = None,
                 panel: PanelLinear | None = None) -> None:
        self.logits = logits
        self.greedy = greedy
        self.panels = panels  # the weight in pack_panels' layout (shared with a PackedLinear head's)
        self.panel = panel  # the panel kernel bound to it (float32 out), where it is taken: every call

    @classmethod
    def of(cls, model: nn.Module) -> LMHead:
        """From `model.lm_head` (a QuantLinear, PackedLinear or nn.Linear) or, tied and unpacked,
        `model.embed_tokens`; a head with a bias, or off the CPU, reads its logits through
        float_logits."""
        head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
        if isinstance(head, QuantLinear):
            return cls(lambda x: head(x.float()), head.greedy)
        weight = embed.weight if head is None else head.weight
        if head is not None and head.bias is not None:
            slow = lambda x: float_logits(head, embed, x)  # noqa: E731
            return cls(slow, lambda x: row_argmax(slow(x)))
        if weight.device.type != "cpu":  # the Triton head+argmax (float32 sums) where it launches
            return cls(lambda x: float_logits(head, embed, x), lambda x: lm_head_argmax(x, weight))
        panels = getattr(head, "panels", None)  # a PackedLinear's copy for the panel kernel: the same layout
        panels = panels if panels is not None else pack_panels(weight)
        n, k = weight.shape
        panel = (PanelLinear(panels, n, k, float_out=True)
                 if panels_wanted(weight.dtype) and panel_linear_applies(n, k, weight.dtype) else None)
        if weight.dtype == torch.float32:  # the head's own GEMM: oneDNN's packed one where it is packed
            wide = head if head is not None else (lambda x: F.linear(x, weight))
        else:
            wide = lambda x: lm_head_logits(x, weight, panels)  # noqa: E731
        return cls(lambda x: _panel_or(x, panel, wide),
                   lambda x: _greedy(x, panel, lambda r: lm_head_argmax(r, weight, panels)), panels, panel)


def _panel_or(x: torch.Tensor, panel: PanelLinear | None,
              wide: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The panel kernel where it is taken (as PackedLinear: every row count), else `wide`."""
    if panel is not None:
        out = panel(x)
        if out is not None:
            return out
    return wide(x)


def _greedy(x: torch.Tensor, panel: PanelLinear | None,
            fused: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Where the panel kernel is taken: its float32 logits, then their argmax (the same logits as
    the sampler's, so a greedy row's token is the same on both paths and in any batch; on a Zen 4
    VM at decode sizes this also beat the fused head+argmax kernel, whose tiles are 16 rows x 1
    panel: docs/benchmarks/history-peers.md, "The greedy head on the panel kernel"); elsewhere the fused kernel, no
    [rows, vocab] logits."""
    if panel is not None:
        logits = panel(x)
        if logits is not None:
            return row_argmax(logits)
    return fused(x)
