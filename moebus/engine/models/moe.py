"""DeepSeek-style MoE block: router (learned top-k or hash), stacked routed experts, shared expert.

Routed experts live in stacked tensors `w13 [E, 2I, H]` (gate rows then up rows) and
`w2 [E, H, I]` so expert parallelism can later shard the leading dim; they run through
`moebus.kernels.fused_moe`. Both routers score with the same learned gate; they differ only in
which experts they pick.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moebus import platforms
from moebus.engine.batch_invariant import invariant_linear, tiled
from moebus.engine.models.quant_experts import QuantExperts
from moebus.kernels import fused_moe, silu_and_mul
from moebus.kernels.fused_moe import ExpertPanels
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.panel_linear import PanelLinear

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


@dataclass(frozen=True, slots=True)
class GroupLimit:
    """Group-limited routing (DeepSeek-V2 `group_limited_greedy`, V3 `noaux_tc`): the experts are
    split into `num_groups` equal groups, each group scored (`max`: its best expert, V2;
    `top2_sum`: its best two, V3), and a token picks its top-k among the experts of its
    `topk_groups` best groups only."""

    num_groups: int
    topk_groups: int
    group_score: str  # "max" | "top2_sum"

    def check(self, num_experts: int, top_k: int) -> None:
        if self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"group_score must be 'max' or 'top2_sum', not {self.group_score!r}")
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group {self.num_groups} must divide n_routed_experts {num_experts}")
        per_group = num_experts // self.num_groups
        if not 1 <= self.topk_groups <= self.num_groups or self.topk_groups * per_group < top_k:
            raise ValueError(f"topk_group {self.topk_groups} of {self.num_groups} groups holds fewer than "
                             f"num_experts_per_tok {top_k} experts")
        if self.group_score == "top2_sum" and per_group < 2:
            raise ValueError("top2_sum group scores need at least 2 experts per group")

    def mask(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's chosen groups set to -inf."""
        grouped = choice.view(choice.shape[0], self.num_groups, choice.shape[1] // self.num_groups)  # 0 rows too
        if self.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class Router(nn.Module):
    """Learned top-k router, or (`hash_vocab_size` set) hash router: `tid2eid[input_ids]` picks experts.

    Top-k selection uses `scores + e_score_correction_bias` (the bias only balances load; a router
    built with score_bias=False has none), limited to the best groups with `groups`; the
    combine weights use the unbiased scores, optionally renormalised over the chosen k, then
    scaled by `routed_scaling_factor`.
    """

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring_func: str,
                 norm_topk_prob: bool, routed_scaling_factor: float, hash_vocab_size: int | None,
                 score_bias: bool = True, groups: GroupLimit | None = None):
        super().__init__()
        if groups is not None:
            groups.check(num_experts, top_k)
        self.groups = groups
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.is_hash = hash_vocab_size is not None
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, top_k, dtype=torch.int64))
        elif score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _float_weight(self) -> torch.Tensor:
        """The gate in float32, converted once (again only if the weight is written), and where the
        CPU runs the panel kernel its panels, padded to whole panels of 16 experts."""
        key = (self.weight.data_ptr(), self.weight._version, self.weight.dtype)
        if getattr(self, "_w32_key", None) != key:
            self._w32, self._w32_key = self.weight.detach().float(), key
            e, h = self._w32.shape
            self._panel = (PanelLinear(pack_panels(self._w32), -(-e // 16) * 16, h)
                           if platforms.current(self._w32.device).panels_wanted(torch.float32) else None)
        return self._w32

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 router logits [T, E]. On the panel kernel where it runs: each row summed in one
        order whatever the batch, so a token's experts and weights never depend on its neighbours
        (torch's GEMM picks its blocking by row count)."""
        w = self._float_weight()
        x = x.float()
        if self._panel is not None and (out := self._panel(x if x.stride(-1) == 1 else x.contiguous())) is not None:
            return out[:, :w.shape[0]]
        return F.linear(x, w)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        # Router math in float32 so expert choice does not flip with the activation dtype.
        if (self.scoring_func == "softmax" and self.norm_topk_prob and not self.is_hash and self.groups is None
                and self.e_score_correction_bias is None and not self.batch_invariant):
            # softmax, top-k, renormalise == top-k of the logits, softmax over those k (one
            # softmax over k values instead of E, no gather or sum): a decode step's 24 routers
            # ran ~8 small ops each
            top, ids = torch.topk(self._logits(x), self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
            return (weights if self.routed_scaling_factor == 1.0 else weights * self.routed_scaling_factor), ids
        if self.batch_invariant:  # torch's scalar tail and SIMD body round softplus/exp differently:
            scores = tiled(lambda c: router_scores(self._logits(c), self.scoring_func), x.float())  # fixed tiles
        else:
            scores = router_scores(self._logits(x), self.scoring_func)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
            if self.groups is not None:
                choice = self.groups.mask(choice)
            ids = torch.topk(choice, self.top_k, dim=-1).indices
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
        self.blocks: nn.ModuleList | None = None  # [gate|up, down] on GGUF blocks: use_blocks

    def use_blocks(self, gate_up: nn.Module, down: nn.Module) -> None:
        """Serve from two linear modules (QuantLinears on a GGUF's blocks, batch invariant as they
        are): the dense weights become empty, non-loaded buffers."""
        h, i = self.gate_up_proj.shape[1], self.down_proj.shape[1]
        if (gate_up.in_features, gate_up.out_features, down.in_features, down.out_features) != (h, 2 * i, i, h):
            raise ValueError(f"shared expert blocks: {gate_up} / {down}, the layer is {h} -> {2 * i} -> {h}")
        dev = self.gate_up_proj.device
        del self.gate_up_proj, self.down_proj
        self.register_buffer("gate_up_proj", torch.empty(0, h, device=dev), persistent=False)
        self.register_buffer("down_proj", torch.empty(h, 0, device=dev), persistent=False)
        self.blocks = nn.ModuleList([gate_up, down])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            gate_up, down = self.blocks
            return down(silu_and_mul(gate_up(x), limit=self.swiglu_limit))
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
                 routed_scaling_factor: float, swiglu_limit: float | None, hash_vocab_size: int | None,
                 score_bias: bool = True, groups: GroupLimit | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.swiglu_limit = swiglu_limit
        self.gate = Router(hidden_size, num_experts, top_k, scoring_func, norm_topk_prob,
                           routed_scaling_factor, hash_vocab_size, score_bias, groups)
        self.w13 = nn.Parameter(torch.zeros(num_experts, 2 * moe_intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.zeros(num_experts, hidden_size, moe_intermediate_size))
        self.shared_experts = (SharedExpert(hidden_size, num_shared_experts * moe_intermediate_size, swiglu_limit)
                               if num_shared_experts > 0 else None)
        self.load_counter: torch.Tensor | None = None
        self.panels = ExpertPanels()  # the CPU panel kernel's packed copy of w13 / w2, made on first use
        self.quant_experts: QuantExperts | None = None  # set by use_quantized_experts

    def use_quantized_experts(self, experts: QuantExperts) -> None:
        """Serve the routed experts from GGUF blocks: w13 / w2 become empty, non-loaded buffers."""
        if experts.num_experts != self.num_experts:
            raise ValueError(f"{experts.num_experts} quantized experts, the layer has {self.num_experts}")
        dev = self.w13.device
        e, _, h = self.w13.shape
        del self.w13, self.w2
        self.register_buffer("w13", torch.empty(e, 0, h, device=dev), persistent=False)
        self.register_buffer("w2", torch.empty(e, h, 0, device=dev), persistent=False)
        self.quant_experts = experts

    def enable_load_counting(self) -> None:
        self.load_counter = torch.zeros(self.num_experts, dtype=torch.int64, device=self.w13.device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x, input_ids)
        if self.load_counter is not None:
            self.load_counter += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        if self.quant_experts is not None:  # one formula at every batch: batch invariant as it is
            out = self.quant_experts(x, topk_weights, topk_ids, self.swiglu_limit)
        else:
            out = fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, swiglu_limit=self.swiglu_limit,
                            batch_invariant=self.batch_invariant, panels=self.panels)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def enable_expert_load_counting(model: nn.Module) -> list[torch.Tensor]:
    """Start counting routed assignments in every MoE layer of `model`; their live `load_counter [E]`s."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.enable_load_counting()
    return [moe.load_counter for moe in moes]
