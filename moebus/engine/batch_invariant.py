"""Deterministic mode: make a row's result independent of what else is in the batch.

CPU GEMM kernels pick blocking by M, so a token's activations change in the last bits with the
batch size. Running every linear layer in fixed 16-row tiles (zero-padded) makes each row go
through the same kernel with the same blocking whatever the batch holds; attention already runs
per sequence on the deterministic path. Modules that multiply by raw weights (F.linear, einsum)
declare a `batch_invariant` attribute, which `make_batch_invariant` sets, and then tile those
products with `invariant_linear` / `tiled`; the MoE then routes every batch size through the
per-token C kernel (without a C compiler the routed experts stay batch-dependent). Measured cost:
see BENCHMARKS.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILE = 16


def tiled(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply fn (row-wise in intent) to x [T, ...] in zero-padded TILE-row chunks."""
    t = x.shape[0]
    pad = (-t) % TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    out = torch.cat([fn(x[i:i + TILE]) for i in range(0, x.shape[0], TILE)])
    return out[:t]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in TILE-row chunks: each row's result is independent of the others."""
    flat = x.reshape(-1, x.shape[-1])
    out = tiled(lambda c: F.linear(c, weight, bias), flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class BatchInvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of the model for a tiled one sharing the same parameters, and switch
    on the modules that declare a `batch_invariant` attribute."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = BatchInvariantLinear.__new__(BatchInvariantLinear)
                nn.Module.__init__(new)
                new.in_features, new.out_features = child.in_features, child.out_features
                new.weight, new.bias = child.weight, child.bias
                setattr(parent, name, new)
    return model
