"""A model's LM head as the engine reads it: hidden rows -> float32 logits, or greedy token ids.

One rule on every path (the sampler, logprobs, speculative verification, the greedy head, the
quantized head, deterministic mode): the logits are float32 sums of the storage-dtype products,
never rounded to the storage dtype first, and greedy takes the first maximum of each row (the
lowest token id among equal float32 logits; a row holding a NaN gives its first NaN), torch's
`max(dim=1).indices`. Rounding bf16 logits broke near-ties: bf16 steps by 0.125 at a logit of 25,
SmolLM2's first answer token to "What is the capital of France?" leads by 0.08 in float32, and
the rounded tie went to the lower token id (the answer began "L'Étoile" instead of "The capital").

Paths differ only in summation order. Where the panel kernel is taken (AVX-512 without AMX) it
serves every call, so a row's logits never depend on the rest of the batch. The device's platform
binds a dense head (platforms/cpu/lm_head.py; elsewhere the Triton head+argmax).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moebus import platforms
from moebus.engine.quant_linear import QuantLinear
from moebus.kernels.argmax import row_argmax
from moebus.kernels.lm_head_argmax import lm_head_logits
from moebus.kernels.panel_linear import PanelLinear


def float_logits(head: nn.Module | None, embed: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A model's compute_logits: hidden [M, H] -> float32 [M, V] by its head (None: tied to
    `embed`'s weight). For tests and tools: a bf16 head without a PackedLinear's panels is packed
    again at each call; the engine (steps, MTP drafts) reads the LMHead its runner binds once."""
    if isinstance(head, QuantLinear):
        return head(hidden.float())
    if head is not None and platforms.current(head.weight.device).float_head(head):
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
        `model.embed_tokens`; a head with a bias reads its logits through float_logits, a dense
        bias-free one is bound by the device's platform (off the CPU: float_logits too)."""
        head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
        if isinstance(head, QuantLinear):
            return cls(lambda x: head(x.float()), head.greedy)
        weight = embed.weight if head is None else head.weight
        if head is not None and head.bias is not None:
            slow = lambda x: float_logits(head, embed, x)  # noqa: E731
            return cls(slow, lambda x: row_argmax(slow(x)))
        return platforms.current(weight.device).bind_lm_head(head, embed, weight)
