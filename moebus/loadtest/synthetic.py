"""Synthetic traces: Poisson (burstiness 1) or gamma arrivals at a given rate, with lengths drawn
from a named distribution around given means. Seeded: the same arguments give the same trace."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .trace import TraceRequest

DISTRIBUTIONS = ("fixed", "uniform", "exponential")


@dataclass(slots=True)
class SyntheticSpec:
    rate: float  # requests per second
    num_requests: int
    input_tokens: int  # mean prompt length
    output_tokens: int  # mean output length
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    length_dist: str = "fixed"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.num_requests < 1 or self.burstiness <= 0:
            raise ValueError("rate and burstiness must be > 0, num_requests >= 1")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError("input and output lengths must be >= 1")
        if self.length_dist not in DISTRIBUTIONS:
            raise ValueError(f"length_dist must be one of {DISTRIBUTIONS}")


def synthetic_trace(spec: SyntheticSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    # Gamma inter-arrival gaps with shape k and mean 1/rate (k = 1: exponential, a Poisson process).
    k = spec.burstiness
    t, out = 0.0, []
    for i in range(spec.num_requests):
        if i:
            t += rng.gammavariate(k, 1.0 / (spec.rate * k))
        out.append(TraceRequest(t, _length(rng, spec.input_tokens, spec.length_dist),
                                _length(rng, spec.output_tokens, spec.length_dist), line=i + 1))
    return out


def _length(rng: random.Random, mean: int, dist: str) -> int:
    if dist == "uniform":  # mean +- 50%
        return max(1, round(rng.uniform(0.5 * mean, 1.5 * mean)))
    if dist == "exponential":
        return max(1, round(rng.expovariate(1.0 / mean)))
    return mean
