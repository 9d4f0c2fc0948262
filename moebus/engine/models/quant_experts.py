"""A MoE layer's routed experts served from a GGUF's Q4_0 / Q4_1 / Q8_0 blocks (weight_format
"gguf"), on kernels/qmoe.py's panels with float32 activations.

Only the panels are kept (the GGUF rows are dropped after packing: the experts are most of an MoE's
weights, and a second copy would double them). The panels run on any CPU the C library builds for
(AVX-512: integer dot products; elsewhere a plain C tile, right but slow); CUDA and expert
parallelism take dense experts (weight_format "dense"), and say so.
"""
from __future__ import annotations

import torch
from torch import nn

from moebus import platforms
from moebus.kernels.qmoe import available, pack_experts, qmoe_cpu, shapes_ok
from moebus.kernels.quant_matmul import check_weight


class QuantExperts(nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, qtype: str, hidden: int, intermediate: int,
                 qtype2: str | None = None) -> None:
        """w13: GGUF rows uint8 [E, 2I, hidden / 32 * block bytes] (gate rows, then up rows) of `qtype`;
        w2 [E, hidden, I / 32 * block bytes] of `qtype2` (None: `qtype`)."""
        super().__init__()
        e = w13.shape[0]
        if w13.dim() != 3 or w2.dim() != 3 or w2.shape[0] != e:
            raise ValueError(f"quantized experts: shapes {tuple(w13.shape)}, {tuple(w2.shape)}")
        check_weight(w13.reshape(-1, w13.shape[2]), qtype, hidden)
        qtype2 = qtype2 or qtype
        check_weight(w2.reshape(-1, w2.shape[2]), qtype2, intermediate)
        if w13.shape[1] != 2 * intermediate or w2.shape[1] != hidden:
            raise ValueError(f"quantized experts: {tuple(w13.shape[:2])} / {tuple(w2.shape[:2])} rows, the config "
                             f"needs {2 * intermediate} / {hidden}")
        if not shapes_ok(hidden, intermediate) or not available():
            raise ValueError(f"quantized experts need hidden {hidden} and intermediate {intermediate} in blocks "
                             "of 32 and the C library (csrc/qmoe_cpu.c)")
        self.qtype, self.qtype2, self.num_experts, self.hidden, self.intermediate = qtype, qtype2, e, hidden, intermediate
        self.register_buffer("p13", pack_experts(w13, qtype, hidden), persistent=False)
        self.register_buffer("p2", pack_experts(w2, qtype2, intermediate), persistent=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        if not platforms.of(x).quantized_experts:
            raise RuntimeError("quantized experts run on CPU only: serve this model with weight_format 'dense'")
        out = qmoe_cpu(x, self.p13, self.p2, self.qtype, topk_weights, topk_ids, self.intermediate, swiglu_limit,
                       qtype2=self.qtype2)
        if out is None:
            raise RuntimeError("csrc/qmoe_cpu.c is not available")
        return out.to(x.dtype)
