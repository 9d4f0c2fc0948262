"""Paired A/B timing in one process: variants take turns for N rounds, so a drift in the machine's
speed (other processes on a shared box, clocks, caches) hits every variant alike; medians per variant.

Even rounds run the variants in the given order, odd rounds reversed (A B, B A, ...), so no variant
always runs right after the same other one. The loadtest/ scripts (ab_greedy_head, bench_sampler,
profile_decode) time with it.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rounds:
    """One variant's times (seconds, one per round, in round order)."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("no rounds")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> tuple[float, float]:
        """(fastest, slowest) round: with a handful of rounds, quantiles would be these anyway."""
        return min(self.samples), max(self.samples)


def alternate(variants: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 0,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, Rounds]:
    """Call each variant once per round for `rounds` rounds (after `warmup` untimed rounds), timing
    each call with `clock` (time.process_time for CPU time of this process)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(warmup + rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t = clock()
            variants[name]()
            if r >= warmup:
                times[name].append(clock() - t)
    return {k: Rounds(tuple(v)) for k, v in times.items()}


def wins(a: Rounds, b: Rounds) -> int:
    """In how many rounds `a` took less time than `b` (the rounds are paired)."""
    return sum(x < y for x, y in zip(a.samples, b.samples, strict=True))
