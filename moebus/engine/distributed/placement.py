"""Expert -> rank placement: which logical expert each rank's physical expert slots hold.

Every rank holds the same number of slots (`slots_per_rank`), so the local weight tensors keep
their shape when EPLB moves experts around. `num_ranks * slots_per_rank - num_experts` slots are
redundant replicas; a rank never holds two copies of one expert (a second local copy would not
take load off that rank). Pure python: the planner and tests do not need torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    num_experts: int
    slots: tuple[tuple[int, ...], ...]  # slots[rank][slot] = logical expert id

    def __post_init__(self) -> None:
        if not self.slots or not self.slots[0]:
            raise ValueError("placement needs at least one rank with one slot")
        width = len(self.slots[0])
        if width > self.num_experts:
            raise ValueError(f"{width} slots per rank > {self.num_experts} experts: a rank would hold duplicates")
        seen: set[int] = set()
        for r, row in enumerate(self.slots):
            if len(row) != width:
                raise ValueError(f"rank {r} has {len(row)} slots, rank 0 has {width}")
            if len(set(row)) != len(row):
                raise ValueError(f"rank {r} holds an expert twice: {row}")
            if any(not 0 <= e < self.num_experts for e in row):
                raise ValueError(f"rank {r}: expert id out of [0, {self.num_experts}): {row}")
            seen.update(row)
        if len(seen) != self.num_experts:
            raise ValueError(f"experts without a replica: {sorted(set(range(self.num_experts)) - seen)}")

    @classmethod
    def from_lists(cls, num_experts: int, slots: Sequence[Sequence[int]]) -> Placement:
        return cls(num_experts, tuple(tuple(int(e) for e in row) for row in slots))

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, num_redundant: int = 0) -> Placement:
        """Experts 0..E-1 then the first `num_redundant` again, cut into equal per-rank runs.

        Any run of <= E consecutive ids mod E is duplicate-free, so this is always valid.
        """
        total = num_experts + num_redundant
        if num_ranks < 1 or total % num_ranks:
            raise ValueError(f"{num_experts} experts + {num_redundant} redundant must split evenly "
                             f"over {num_ranks} ranks")
        width = total // num_ranks
        flat = [i % num_experts for i in range(total)]
        return cls.from_lists(num_experts, [flat[r * width:(r + 1) * width] for r in range(num_ranks)])

    @property
    def num_ranks(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    def replicas(self, expert: int) -> list[tuple[int, int]]:
        """(rank, slot) of every copy of `expert`, in rank order."""
        return [(r, s) for r, row in enumerate(self.slots) for s, e in enumerate(row) if e == expert]

    def num_replicas(self) -> list[int]:
        counts = [0] * self.num_experts
        for row in self.slots:
            for e in row:
                counts[e] += 1
        return counts

    def rank_loads(self, expert_loads: Sequence[float]) -> list[float]:
        """Expected per-rank load when each expert's tokens split evenly over its replicas."""
        reps = self.num_replicas()
        return [sum(expert_loads[e] / reps[e] for e in row) for row in self.slots]


def imbalance(rank_loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0 = perfectly balanced; 1.0 when there is no load)."""
    mean = sum(rank_loads) / len(rank_loads)
    return max(rank_loads) / mean if mean > 0 else 1.0
