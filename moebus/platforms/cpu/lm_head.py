"""The LM head on CPU (engine/lm_head.py's rule: float32 logits, the first maximum): where the panel
kernel is taken (AVX-512 without AMX) it serves every call, so a row's logits never depend on the
rest of the batch; elsewhere the head's own GEMM for logits and the fused head+argmax kernel."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moebus.engine.lm_head import LMHead
from moebus.kernels.argmax import row_argmax
from moebus.kernels.lm_head_argmax import lm_head_argmax, lm_head_logits, pack_panels
from moebus.kernels.panel_linear import PanelLinear, panel_linear_applies
from moebus.platforms.cpu.packed_linear import panels_wanted


def bind(head: nn.Module | None, weight: torch.Tensor) -> LMHead:
    """A bias-free dense head (a PackedLinear, nn.Linear, or None: tied to the embedding `weight`)."""
    panels = getattr(head, "panels", None)  # a PackedLinear's copy for the panel kernel: the same layout
    panels = panels if panels is not None else pack_panels(weight)
    n, k = weight.shape
    panel = (PanelLinear(panels, n, k, float_out=True)
             if panels_wanted(weight.dtype) and panel_linear_applies(n, k, weight.dtype) else None)
    if weight.dtype == torch.float32:  # the head's own GEMM: oneDNN's packed one where it is packed
        wide = head if head is not None else (lambda x: F.linear(x, weight))
    else:
        wide = lambda x: lm_head_logits(x, weight, panels)  # noqa: E731
    return LMHead(lambda x: _panel_or(x, panel, wide),
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
