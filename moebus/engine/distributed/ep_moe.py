"""Expert-parallel MoE layer: routed experts sharded over ranks, tokens moved by all-to-all.

Each rank routes its own tokens (the router and shared expert are replicated), then:
1. picks one replica per (token, slot) assignment -- a "physical slot" `rank * S + slot`;
   an expert's assignments are dealt round-robin over its replicas, so copies share its load;
2. exchanges per-(rank, slot) counts (all_to_all_single), so receivers know split sizes and
   which local slot each received row is for without shipping ids;
3. dispatches hidden rows (sorted by physical slot) with all_to_all_single;
4. runs `fused_moe` over the local slots (k=1, weight 1: the GEMM outputs unweighted);
5. sends the rows back and combines the k slots in float32, exactly as `fused_moe_ref` does.
So outputs equal the single-process `MoE` up to GEMM batch-composition rounding. Every rank
must call every EP layer once per model step (ranks without tokens call with 0 rows:
`dummy_forward`), or the collectives deadlock.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moebus.engine.distributed.group import EPGroup
from moebus.engine.distributed.placement import Placement
from moebus.engine.models.moe import MoE
from moebus.kernels import fused_moe
from moebus.kernels.fused_moe import ExpertPanels


class EPMoE(nn.Module):
    def __init__(self, moe: MoE, placement: Placement, group: EPGroup):
        super().__init__()
        if moe.quant_experts is not None:
            raise ValueError("expert parallelism moves dense expert weights: serve this GGUF with weight_format "
                             "'dense'")
        if placement.num_ranks != group.world_size or placement.num_experts != moe.num_experts:
            raise ValueError(f"placement is {placement.num_ranks} ranks x {placement.num_experts} experts; "
                             f"group has {group.world_size} ranks, the layer {moe.num_experts} experts")
        self.num_experts = moe.num_experts
        self.swiglu_limit = moe.swiglu_limit
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.group = group
        local = torch.tensor(placement.slots[group.rank], device=moe.w13.device)
        # Local slots only; the full [E, ...] stacks are dropped with the wrapped MoE.
        self.w13 = nn.Parameter(moe.w13.data[local].clone(), requires_grad=False)
        self.w2 = nn.Parameter(moe.w2.data[local].clone(), requires_grad=False)
        self.load_counter: torch.Tensor | None = None  # [E] assignments this rank routed
        self.slot_load: torch.Tensor | None = None  # [S] assignments this rank's slots computed
        self.num_calls = 0  # forwards run (real or dummy): the DP engine checks lockstep with it
        self.panels = ExpertPanels()  # repacked by itself when an EPLB move rewrites w13 / w2
        self.set_placement(placement)

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    def set_placement(self, placement: Placement) -> None:
        """Point routing at `placement`; the local weights must already match it (see eplb)."""
        self.placement = placement
        reps = [[r * placement.slots_per_rank + s for r, s in placement.replicas(e)]
                for e in range(self.num_experts)]
        width = max(len(r) for r in reps)
        table = [r + [r[0]] * (width - len(r)) for r in reps]
        dev = self.w13.device
        self.register_buffer("rep_table", torch.tensor(table, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("num_rep", torch.tensor([len(r) for r in reps], dtype=torch.long, device=dev),
                             persistent=False)
        self._single_replica = width == 1

    def enable_load_counting(self) -> None:
        dev = self.w13.device
        self.load_counter = torch.zeros(self.num_experts, dtype=torch.int64, device=dev)
        self.slot_load = torch.zeros(self.slots_per_rank, dtype=torch.int64, device=dev)

    def reset_load_counters(self) -> None:
        for c in (self.load_counter, self.slot_load):
            if c is not None:
                c.zero_()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        topk_weights, topk_ids = self.gate(x, input_ids)
        if self.load_counter is not None:
            self.load_counter += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        out = self._routed(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _pick_replicas(self, flat: torch.Tensor) -> torch.Tensor:
        """Physical slot per assignment: the i-th assignment of expert e (on this rank) goes to
        replica (i + rank) % copies, so each rank spreads an expert's tokens evenly."""
        if self._single_replica:
            return self.rep_table[flat, 0]
        by_e = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        start = counts.cumsum(0) - counts
        pos = torch.empty_like(flat)
        pos[by_e] = torch.arange(flat.numel(), device=flat.device) - start[flat[by_e]]
        return self.rep_table[flat, (pos + self.group.rank) % self.num_rep[flat]]

    def _routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        h = x.shape[1]
        world, width, pg = self.group.world_size, self.slots_per_rank, self.group.group
        flat = topk_ids.reshape(-1).to(torch.long)
        phys = self._pick_replicas(flat)
        order = torch.argsort(phys, stable=True)  # grouped by destination rank, then slot
        send_counts = torch.bincount(phys, minlength=world * width)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=pg)
        send_splits, recv_splits = torch.stack([send_counts.view(world, width).sum(1),
                                                recv_counts.view(world, width).sum(1)]).tolist()
        recv_x = x.new_empty(sum(recv_splits), h)
        dist.all_to_all_single(recv_x, x[order // k], recv_splits, send_splits, group=pg)
        slot_ids = torch.arange(width, device=x.device).repeat(world).repeat_interleave(recv_counts)
        ones = torch.ones(slot_ids.numel(), 1, dtype=torch.float32, device=x.device)
        y = fused_moe(recv_x, self.w13, self.w2, ones, slot_ids[:, None], swiglu_limit=self.swiglu_limit,
                      panels=self.panels)
        if self.slot_load is not None:
            self.slot_load += recv_counts.view(world, width).sum(0)
        back = x.new_empty(t * k, h)
        dist.all_to_all_single(back, y, send_splits, recv_splits, group=pg)
        y_assign = back[torch.argsort(order)].view(t, k, h).float()
        return torch.einsum("tk,tkd->td", topk_weights.float(), y_assign).to(x.dtype)


def find_moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every MoE / EPMoE in forward (registration) order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE | EPMoE)]


def shard_moe_layers(model: nn.Module, group: EPGroup, num_redundant_experts: int = 0,
                     placements: list[Placement] | None = None) -> list[EPMoE]:
    """Swap each `MoE` of `model` for an `EPMoE` holding this rank's experts (in place).

    Default placement: contiguous expert runs per rank plus `num_redundant_experts` copies.
    """
    found = [(name, m) for name, m in find_moe_layers(model) if isinstance(m, MoE)]
    if placements is not None and len(placements) != len(found):
        raise ValueError(f"{len(placements)} placements for {len(found)} MoE layers")
    layers = []
    for i, (name, moe) in enumerate(found):
        p = placements[i] if placements is not None else \
            Placement.contiguous(moe.num_experts, group.world_size, num_redundant_experts)
        ep = EPMoE(moe, p, group)
        if moe.load_counter is not None:
            ep.enable_load_counting()
        model.set_submodule(name, ep)
        layers.append(ep)
    return layers


@torch.inference_mode()
def dummy_forward(layers: list[EPMoE]) -> None:
    """Join one model step's collectives with no tokens (a DP rank with nothing scheduled)."""
    for layer in layers:
        x = layer.w13.new_empty(0, layer.w13.shape[2])
        layer(x, torch.empty(0, dtype=torch.long, device=x.device))
