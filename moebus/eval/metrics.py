"""Per-token quality metrics of a candidate's logits against the reference's, in float64.

Everything here is a pure function of tensors (logits [T, V], token ids [T]) or a small
accumulator of their sums, so the CLI and the quality-gate tests compute the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[T] float64: -log p(target) under softmax(logits)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[T] float64: KL(ref || candidate) in nats, per row."""
    ref_logp = torch.log_softmax(ref_logits.double(), dim=-1)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def same_top(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[T] bool: the candidate's argmax equals the reference's."""
    return ref_logits.argmax(-1) == logits.argmax(-1)


def margin(ref_logits: torch.Tensor, ref_token: int, other_token: int) -> float:
    """How far the reference prefers its own token over the other one (logits of one row)."""
    return float(ref_logits[ref_token].double() - ref_logits[other_token].double())


def first_divergence(ref: list[int], tokens: list[int]) -> int | None:
    """The first position where the two token lists differ, over their common length."""
    return next((i for i, (a, b) in enumerate(zip(ref, tokens, strict=False)) if a != b), None)


@dataclass(slots=True)
class PerplexityStats:
    """Running sums over scored tokens; `add` takes one chunk's rows."""

    tokens: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    same_top: int = 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor | None = None) -> None:
        """ref_logits None: the reference itself (no KL, no top-token agreement)."""
        self.tokens += targets.numel()
        self.nll_sum += float(token_nll(logits, targets).sum())
        if ref_logits is not None:
            self.kl_sum += float(token_kl(ref_logits, logits).sum())
            self.same_top += int(same_top(ref_logits, logits).sum())

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens

    @property
    def same_top_pct(self) -> float:
        return 100.0 * self.same_top / self.tokens


@dataclass(frozen=True, slots=True)
class Divergence:
    prompt: int  # index in the prompt set
    position: int  # generated token index of the first difference
    margin: float  # reference fp32's logit(its token) - logit(the candidate's token) there


@dataclass(slots=True)
class GreedyStats:
    """Exact-match prompts and first divergences, split into ties and real ones by `tie_margin`."""

    prompts: int
    tie_margin: float
    divergences: list[Divergence]

    def is_tie(self, d: Divergence) -> bool:
        """The reference itself barely preferred its token: either choice is a correct greedy step."""
        return d.margin < self.tie_margin

    @property
    def ties(self) -> list[Divergence]:
        return [d for d in self.divergences if self.is_tie(d)]

    @property
    def real(self) -> list[Divergence]:
        return [d for d in self.divergences if not self.is_tie(d)]

    @property
    def matched(self) -> int:
        return self.prompts - len(self.divergences)


def greedy_stats(ref_tokens: list[list[int]], ref_logits: list[torch.Tensor], tokens: list[list[int]],
                 tie_margin: float) -> GreedyStats:
    """ref_logits[i]: the reference's logits [N, V] along its own greedy path of prompt i."""
    divergences = []
    for i, (ref, ours, logits) in enumerate(zip(ref_tokens, tokens, ref_logits, strict=True)):
        pos = first_divergence(ref, ours)
        if pos is not None:
            divergences.append(Divergence(i, pos, margin(logits[pos], ref[pos], ours[pos])))
    return GreedyStats(len(ref_tokens), tie_margin, divergences)
