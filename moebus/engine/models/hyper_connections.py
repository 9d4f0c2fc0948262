"""Manifold-constrained hyper-connections (mHC), as used by every DeepSeek-V4 decoder block.

The residual is `n = hc_mult` parallel streams `[T, n, H]` instead of one `[T, H]`. Before a
block (attention or MoE) a per-token learned mixture collapses the streams into its input
("pre"); after it the block output is spread back over the streams ("post") and added to the
streams mixed by a per-token doubly-stochastic matrix ("comb", Sinkhorn-Knopp projected).
All mixing weights are computed in float32 from the RMS-normalised flattened streams.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebus.engine.batch_invariant import invariant_linear, tiled
from moebus.kernels import hc_merge, hc_pre


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """Weights for one block's mHC; parameter names follow HF (`attn_hc.fn`, `.base`, `.scale`)."""

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult  # pre [n] + post [n] + comb [n*n]
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (block input [T, H], post [T, n] f32, comb [T, n, n] f32)."""
        # RMS, mixture GEMM, gates + Sinkhorn and collapse: one C call per token pair on CPU
        return hc_pre(streams, self.fn.float(), self.base.float(), self.scale.float(), self.n, self.sinkhorn_iters,
                      self.hc_eps, self.norm_eps, linear=invariant_linear if self.batch_invariant else F.linear)

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """New streams: out_k = post_k * block_out + sum_j comb[j, k] * streams_j."""
        return hc_merge(streams, block_out, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm (HF `model.hc_head.*`)."""

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        def gate(x: torch.Tensor) -> torch.Tensor:
            mix = F.linear(x, self.hc_fn.float())
            return torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps

        x = _unit_rms(streams.flatten(1).float(), self.norm_eps)
        # Deterministic mode: fixed tiles for the GEMM and for sigmoid (torch's SIMD body and
        # scalar tail may round it differently).
        pre = tiled(gate, x) if self.batch_invariant else gate(x)
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
