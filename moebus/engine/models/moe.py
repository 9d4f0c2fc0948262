"""DeepSeek-style MoE block: router (learned top-k or hash), stacked routed experts, shared expert.

Routed experts live in stacked tensors `w13 [E, 2I, H]` (gate rows then up rows) and
`w2 [E, H, I]` so expert parallelism can later shard the leading dim; they run through
`moebus.kernels.fused_moe`. Both routers score with the same learned gate; they differ only in
which experts they pick.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebus.engine.batch_invariant import invariant_linear, tiled
from moebus.kernels import fused_moe, silu_and_mul

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


class Router(nn.Module):
    """Learned top-k router, or (`hash_vocab_size` set) hash router: `tid2eid[input_ids]` picks experts.

    Top-k selection uses `scores + e_score_correction_bias` (the bias only balances load); the
    combine weights use the unbiased scores, optionally renormalised over the chosen k, then
    scaled by `routed_scaling_factor`.
    """

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str,
                 norm_topk_prob: bool, routed_scaling_factor: float, hash_vocab_size: int | None):
        super().__init__()
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.is_hash = hash_vocab_size is not None
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, top_k, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        # Router math in float32 so expert choice does not flip with the activation dtype.
        w = self.weight.float()
        if self.batch_invariant:  # torch's scalar tail and SIMD body round softplus/exp differently:
            scores = tiled(lambda c: router_scores(F.linear(c, w), self.scoring_func), x.float())  # fixed tiles
        else:
            scores = router_scores(F.linear(x.float(), w), self.scoring_func)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class SharedExpert(nn.Module):
    """Dense SwiGLU MLP every token goes through; gate/up fused into one [2I, H] matrix."""

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = invariant_linear if self.batch_invariant else F.linear
        return linear(silu_and_mul(linear(x, self.gate_up_proj), limit=self.swiglu_limit), self.down_proj)


class MoE(nn.Module):
    """Routed experts + shared expert.

    Load accounting for expert balancing: call `enable_load_counting()`, then `load_counter [E]`
    accumulates how many (token, slot) assignments each expert received; reset by zeroing it.
    """

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 num_shared_experts: int, scoring_func: str, norm_topk_prob: bool,
                 routed_scaling_factor: float, swiglu_limit: float | None, hash_vocab_size: int | None):
        super().__init__()
        self.num_experts = num_experts
        self.swiglu_limit = swiglu_limit
        self.gate = Router(hidden_size, num_experts, top_k, scoring_func, norm_topk_prob,
                           routed_scaling_factor, hash_vocab_size)
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * moe_intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.zeros(num_experts, hidden_size, moe_intermediate_size))
        self.shared_experts = (SharedExpert(hidden_size, num_shared_experts * moe_intermediate_size, swiglu_limit)
                               if num_shared_experts > 0 else None)
        self.load_counter: torch.Tensor | None = None

    def enable_load_counting(self) -> None:
        self.load_counter = torch.zeros(self.num_experts, dtype=torch.int64, device=self.w13.device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x, input_ids)
        if self.load_counter is not None:
            self.load_counter += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        out = fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, swiglu_limit=self.swiglu_limit,
                        batch_invariant=self.batch_invariant)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
