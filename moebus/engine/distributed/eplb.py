"""EPLB: re-place experts from measured loads (redundant copies of hot experts), then move weights.

`plan_placement` (pure python) picks replica counts greedily (each extra slot goes to the expert
with the highest load per replica), packs the replicas onto ranks largest-first into the least
loaded rank with room (bounded slots per rank, no duplicates on a rank), then improves the most
loaded rank with pairwise swaps. Bins are matched to ranks, and experts to slots, so as many
experts as possible stay where they are. `plan_moves` lists the copies a new placement needs;
`move_expert_weights` runs them point-to-point. `rebalance` does it all for every EP layer at a
step boundary: requests and their KV caches are untouched, only routed expert weights move.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moebus.engine.distributed.placement import Placement, imbalance

if TYPE_CHECKING:
    from moebus.engine.distributed.ep_moe import EPMoE
    from moebus.engine.distributed.group import EPGroup


def replica_counts(loads: Sequence[float], total_slots: int, max_replicas: int) -> list[int]:
    n = len(loads)
    if not n <= total_slots <= n * max_replicas:
        raise ValueError(f"{total_slots} slots cannot hold {n} experts with <= {max_replicas} copies each")
    reps = [1] * n
    heap = [(-float(w), e) for e, w in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(total_slots - n):
        while True:  # experts at the cap leave the heap
            _, e = heapq.heappop(heap)
            if reps[e] < max_replicas:
                break
        reps[e] += 1
        heapq.heappush(heap, (-float(loads[e]) / reps[e], e))
    return reps


def _pack(weight: list[float], reps: list[int], num_ranks: int, width: int) -> list[set[int]]:
    bins: list[set[int]] = [set() for _ in range(num_ranks)]
    load = [0.0] * num_ranks
    items = sorted(((weight[e], e) for e in range(len(reps)) for _ in range(reps[e])), key=lambda t: (-t[0], t[1]))
    for w, e in items:
        free = [r for r in range(num_ranks) if len(bins[r]) < width and e not in bins[r]]
        if not free:  # every rank with room holds e: hand one of a full rank's experts over to it
            r2 = next(r for r in range(num_ranks) if len(bins[r]) < width)
            r1, f = min(((r, f) for r in range(num_ranks) if e not in bins[r]
                         for f in bins[r] if f not in bins[r2]), key=lambda rf: (load[rf[0]], rf))
            bins[r1].remove(f)
            bins[r2].add(f)
            load[r1] -= weight[f]
            load[r2] += weight[f]
            free = [r1]
        r = min(free, key=lambda r: (load[r], len(bins[r]), r))
        bins[r].add(e)
        load[r] += w
    _improve(bins, load, weight)
    return bins


def _anchored(weight: list[float], previous: Placement) -> list[set[int]]:
    """The previous placement improved by swaps only: no new replicas, few moves."""
    bins = [set(row) for row in previous.slots]
    load = [sum(weight[e] for e in b) for b in bins]
    _improve(bins, load, weight)
    return bins


def _improve(bins: list[set[int]], load: list[float], weight: list[float]) -> None:
    """Swap one expert of the most loaded rank with one of another rank while that lowers the max."""
    for _ in range(4 * sum(len(b) for b in bins)):
        hi = max(range(len(bins)), key=lambda r: load[r])
        best = None
        for lo in range(len(bins)):
            for a in bins[hi]:
                for b in bins[lo]:
                    d = weight[a] - weight[b]
                    if lo == hi or d <= 0 or a in bins[lo] or b in bins[hi]:
                        continue
                    new_max = max(load[hi] - d, load[lo] + d)
                    if new_max < load[hi] - 1e-9 and (best is None or new_max < best[0]):
                        best = (new_max, lo, a, b, d)
        if best is None:
            return
        _, lo, a, b, d = best
        bins[hi].symmetric_difference_update({a, b})
        bins[lo].symmetric_difference_update({a, b})
        load[hi] -= d
        load[lo] += d


def _keep_in_place(bins: list[set[int]], previous: Placement | None, width: int) -> list[list[int]]:
    """Order bins to ranks and experts to slots to maximise overlap with `previous`."""
    n = len(bins)
    if previous is None or previous.num_ranks != n or previous.slots_per_rank != width:
        return [sorted(b) for b in bins]
    prev = [set(row) for row in previous.slots]
    pairs = sorted(((len(bins[b] & prev[r]), b, r) for b in range(n) for r in range(n)), key=lambda t: (-t[0], t[1], t[2]))
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, b, r in pairs:
        if b not in rank_of and r not in taken:
            rank_of[b] = r
            taken.add(r)
    out: list[list[int]] = [[] for _ in range(n)]
    for b, r in rank_of.items():
        row = [e if e in bins[b] else -1 for e in previous.slots[r]]
        rest = iter(sorted(bins[b] - set(row)))
        out[r] = [e if e >= 0 else next(rest) for e in row]
    return out


def plan_placement(loads: Sequence[float], num_ranks: int, slots_per_rank: int,
                   previous: Placement | None = None) -> Placement:
    """A placement of len(loads) experts on num_ranks x slots_per_rank slots minimising the max rank load.

    With `previous`, the previous layout improved by swaps is a second candidate; it wins ties
    (fewer weight moves), so the plan is never worse than `previous` and keeps it when balanced.
    """
    reps = replica_counts(loads, num_ranks * slots_per_rank, num_ranks)
    weight = [float(w) / r for w, r in zip(loads, reps, strict=True)]
    packed = Placement.from_lists(len(loads), _keep_in_place(_pack(weight, reps, num_ranks, slots_per_rank),
                                                             previous, slots_per_rank))
    if previous is None or previous.num_ranks != num_ranks or previous.slots_per_rank != slots_per_rank:
        return packed
    prev_weight = [float(w) / r for w, r in zip(loads, previous.num_replicas(), strict=True)]
    anchored = Placement.from_lists(len(loads), _keep_in_place(_anchored(prev_weight, previous), previous,
                                                               slots_per_rank))
    max_packed, max_anchored = max(packed.rank_loads(loads)), max(anchored.rank_loads(loads))
    return anchored if max_anchored <= max_packed * (1 + 1e-9) else packed


@dataclass(frozen=True, slots=True)
class Move:
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def plan_moves(old: Placement, new: Placement) -> list[Move]:
    """Copies that turn `old` into `new`, in one order every rank computes alike. A slot whose
    expert already sits on its rank copies locally; otherwise the least-used old holder sends."""
    sent = [0] * old.num_ranks
    moves: list[Move] = []
    for r, row in enumerate(new.slots):
        for s, e in enumerate(row):
            if old.slots[r][s] == e:
                continue
            if e in old.slots[r]:
                moves.append(Move(e, r, old.slots[r].index(e), r, s))
                continue
            src, src_slot = min(old.replicas(e), key=lambda rs: (sent[rs[0]], rs[0]))
            sent[src] += 1
            moves.append(Move(e, src, src_slot, r, s))
    return moves


@torch.no_grad()
def move_expert_weights(tensors: Sequence[torch.Tensor], moves: Sequence[Move], rank: int,
                        group: dist.ProcessGroup | None = None) -> None:
    """Apply `moves` to this rank's per-slot tensors (each [slots, ...]) in place.

    Every source row is read before any slot is overwritten, so slot permutations are safe.
    """
    incoming: list[tuple[int, int, torch.Tensor]] = []  # (tensor index, dst slot, buffer)
    ops: list[dist.P2POp] = []
    for m_idx, m in enumerate(moves):
        for i, t in enumerate(tensors):
            tag = m_idx * len(tensors) + i
            if m.dst_rank == rank and m.src_rank == rank:
                incoming.append((i, m.dst_slot, t[m.src_slot].clone()))
            elif m.dst_rank == rank:
                buf = torch.empty_like(t[m.dst_slot])
                incoming.append((i, m.dst_slot, buf))
                ops.append(dist.P2POp(dist.irecv, buf, m.src_rank, group, tag))
            elif m.src_rank == rank:
                ops.append(dist.P2POp(dist.isend, t[m.src_slot].contiguous(), m.dst_rank, group, tag))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for i, slot, buf in incoming:
        tensors[i][slot].copy_(buf)


@dataclass(frozen=True, slots=True)
class RebalanceReport:
    layer: int
    imbalance_before: float  # max/mean expected rank load under the old placement
    imbalance_after: float
    num_moves: int  # expert copies across ranks
    applied: bool


def rebalance(layers: Sequence[EPMoE], group: EPGroup, min_gain: float = 0.0) -> list[RebalanceReport]:
    """Collective: sum every layer's routed loads over ranks, re-plan, move weights, reset loads.

    A layer keeps its placement unless the plan lowers its max/mean by more than `min_gain`.
    """
    if not layers:
        return []
    if any(layer.load_counter is None for layer in layers):
        raise RuntimeError("rebalance needs load counting: call enable_load_counting() on every EP layer")
    loads = torch.stack([layer.load_counter for layer in layers]).to(torch.float64)
    dist.all_reduce(loads, group=group.group)
    reports = []
    for idx, (layer, row) in enumerate(zip(layers, loads.tolist(), strict=True)):
        old = layer.placement
        new = plan_placement(row, old.num_ranks, old.slots_per_rank, previous=old)
        before, after = imbalance(old.rank_loads(row)), imbalance(new.rank_loads(row))
        applied = after < before * (1.0 - min_gain)
        moves = plan_moves(old, new) if applied else []
        if applied:
            move_expert_weights([layer.w13, layer.w2], moves, group.rank, group.group)
            layer.set_placement(new)
        reports.append(RebalanceReport(idx, before, after if applied else before,
                                       sum(m.src_rank != m.dst_rank for m in moves), applied))
        layer.reset_load_counters()
    return reports
