"""Routing policies beside the default "kv" (KV overlap + load, kv_rank.py), so routing can be
compared on the same trace: "round_robin" (the candidates by id, rotated one further per route)
and "random" (shuffled, seedable). Both ignore load and cache, except that full workers (queue at
max_waiting) still go last, so a route only reaches one when every other refused."""
from __future__ import annotations

import random
from typing import Literal

from .table import WorkerEntry

Policy = Literal["kv", "round_robin", "random"]


class StaticOrder:
    """The round_robin / random orderings: one instance per balancer, called once per route."""

    def __init__(self, policy: Policy, seed: int | None = None) -> None:
        if policy not in ("round_robin", "random"):
            raise ValueError(f"StaticOrder handles round_robin and random, not {policy!r}")
        self.policy = policy
        self._next = 0
        self._rng = random.Random(seed)

    def order(self, entries: list[WorkerEntry]) -> list[WorkerEntry]:
        cands = sorted(entries, key=lambda e: e.worker_id)
        if self.policy == "random":
            self._rng.shuffle(cands)
        elif cands:
            k = self._next % len(cands)
            self._next += 1
            cands = cands[k:] + cands[:k]
        return sorted(cands, key=lambda e: e.full)  # stable: keeps the order among the others
