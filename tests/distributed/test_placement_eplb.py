"""Placement validation and the EPLB planner (pure python; no process group)."""
from __future__ import annotations

import random

import pytest
import torch

from moebus.engine.distributed.eplb import (
    Move,
    _pack,
    move_expert_weights,
    plan_moves,
    plan_placement,
    replica_counts,
)
from moebus.engine.distributed.placement import Placement, imbalance


def test_contiguous_placement_with_redundant_copies():
    p = Placement.contiguous(8, 2)
    assert p.slots == ((0, 1, 2, 3), (4, 5, 6, 7)) and p.num_replicas() == [1] * 8
    p = Placement.contiguous(6, 4, num_redundant=2)
    assert p.slots == ((0, 1), (2, 3), (4, 5), (0, 1))
    assert p.replicas(1) == [(0, 1), (3, 1)] and p.num_replicas() == [2, 2, 1, 1, 1, 1]
    assert p.rank_loads([4, 2, 1, 1, 1, 1]) == [3.0, 2.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="split evenly"):
        Placement.contiguous(8, 3)


@pytest.mark.parametrize("slots, match", [
    ([[0, 1], [1, 1]], "twice"), ([[0, 1], [1, 0]], "without a replica"), ([[0, 1], [2]], "slots"),
    ([[0, 3], [1, 2]], "out of"), ([[0, 1, 2, 0]], "duplicates"),
])
def test_placement_rejects_invalid(slots, match):
    with pytest.raises(ValueError, match=match):
        Placement.from_lists(3, slots)


def test_imbalance():
    assert imbalance([1, 1, 1, 1]) == 1.0
    assert imbalance([4, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0


def test_replica_counts_follow_load_and_cap():
    assert replica_counts([10, 1, 1, 1], 6, max_replicas=2) == [2, 2, 1, 1]
    assert replica_counts([100, 1, 1, 1], 6, max_replicas=4) == [3, 1, 1, 1]
    assert sum(replica_counts([5, 3, 0, 0, 0, 0, 0, 0], 12, max_replicas=2)) == 12
    with pytest.raises(ValueError):
        replica_counts([1, 1, 1], 7, max_replicas=2)


def test_plan_spreads_a_hot_expert():
    loads = [10.0] * 5 + [100.0] + [10.0] * 2  # contiguous(8, 2, 2) copies experts 0 and 1, not 5
    new = plan_placement(loads, num_ranks=2, slots_per_rank=5, previous=Placement.contiguous(8, 2, 2))
    assert new.num_replicas()[5] == 2
    before = imbalance(Placement.contiguous(8, 2, 2).rank_loads(loads))
    after = imbalance(new.rank_loads(loads))
    print(f"hot expert: max/mean {before:.3f} -> {after:.3f}")
    assert after == pytest.approx(1.0) and before > 1.3


@pytest.mark.parametrize("num_experts, num_ranks, redundant", [(8, 2, 0), (8, 2, 2), (16, 4, 4), (12, 4, 8),
                                                               (6, 3, 3), (32, 8, 8), (5, 5, 0)])
def test_plan_is_valid_and_no_worse_than_contiguous(num_experts, num_ranks, redundant):
    rng = random.Random(num_experts * 100 + num_ranks * 10 + redundant)
    width = (num_experts + redundant) // num_ranks
    old = Placement.contiguous(num_experts, num_ranks, redundant)
    for trial in range(40):
        loads = [rng.paretovariate(1.2) * (trial % 3 != 0) + rng.random() for _ in range(num_experts)]
        new = plan_placement(loads, num_ranks, width, previous=old)  # __post_init__ validates it
        got, base = max(new.rank_loads(loads)), max(old.rank_loads(loads))
        assert got <= base + 1e-9
        # Lower bound: the mean, and the hottest expert spread over as many ranks as can hold it.
        bound = max(sum(loads) / num_ranks, max(loads) / num_ranks)
        assert got >= bound - 1e-9


def test_plan_keeps_experts_in_place_when_already_balanced():
    old = Placement.contiguous(8, 2)
    assert plan_placement([1.0] * 8, 2, 4, previous=old) == old
    assert plan_moves(old, old) == []


def test_moves_rebuild_the_new_placement():
    rng = random.Random(0)
    old = Placement.contiguous(16, 4, 4)
    for _ in range(20):
        new = plan_placement([rng.expovariate(1.0) for _ in range(16)], 4, 5, previous=old)
        slots = [list(row) for row in old.slots]
        for m in plan_moves(old, new):
            assert old.slots[m.src_rank][m.src_slot] == m.expert  # sources read the old layout
            slots[m.dst_rank][m.dst_slot] = m.expert
        assert [tuple(r) for r in slots] == list(new.slots)
        old = new


def test_move_expert_weights_local_permutation():
    w = torch.arange(3.0).view(3, 1, 1).repeat(1, 2, 2)  # slot s holds value s
    v = w.clone() * 10
    moves = [Move(0, 0, 1, 0, 0), Move(0, 0, 0, 0, 1), Move(0, 0, 2, 0, 2)]  # swap slots 0 and 1
    move_expert_weights([w, v], moves, rank=0)  # local copies only: no process group needed
    assert w[:, 0, 0].tolist() == [1.0, 0.0, 2.0] and v[:, 0, 0].tolist() == [10.0, 0.0, 20.0]


def test_pack_hands_an_expert_over_when_only_holders_have_room():
    # Greedy order: 0 -> r0, 1..3 fill r1, 4a -> r0; 4b has no rank with room that lacks it.
    bins = _pack([100.0, 1.0, 1.0, 1.0, 0.5], [1, 1, 1, 1, 2], num_ranks=2, width=3)
    assert all(len(b) == 3 for b in bins) and all(4 in b for b in bins)
    assert sorted(e for b in bins for e in b) == [0, 1, 2, 3, 4, 4]
