"""Speculative decoding: draft proposers and the rejection sampler that verifies drafts.

The target model scores K drafts plus one bonus position per request in one forward pass;
`rejection_sample` keeps the longest acceptable draft prefix and appends one token from the
target, so each step emits between 1 and K+1 tokens with the target's own distribution.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from .batch import SamplingBatch
from .processors import exponential_race, row_argmax
from .sampler import prepare_logits, sampling_probs


@runtime_checkable
class DraftModelProposer(Protocol):
    """Hook for a draft model or MTP head: given each request's tokens so far (and the target's
    last hidden states when the drafter consumes them, as MTP does), propose up to k tokens per
    request. Proposers that sample from a distribution should also expose it (draft_probs in
    `rejection_sample`); without it the draft is treated as deterministic (one-hot)."""

    def propose(
        self, batch_token_ids: Sequence[Sequence[int]], hidden_states: Tensor | None, k: int
    ) -> list[list[int]]: ...


@dataclass(slots=True)
class NgramProposer:
    """Prompt-lookup drafting: find the most recent earlier occurrence of the longest suffix
    n-gram (max_n down to min_n) and propose the tokens that followed it."""

    min_n: int = 1
    max_n: int = 3
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Candidate starts 0..size-n-1: each match must be followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + self.num_speculative_tokens].tolist()
        return []

    def propose_batch(
        self, batch_token_ids: Sequence[Sequence[int]], hidden_states: Tensor | None = None, k: int | None = None
    ) -> list[list[int]]:
        """DraftModelProposer-shaped entry point (hidden states unused)."""
        drafts = [self.propose(t) for t in batch_token_ids]
        return drafts if k is None else [d[:k] for d in drafts]


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # requests that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def observe(self, num_draft: Sequence[int], accepted: Sequence[Sequence[int]]) -> None:
        """Record one verification step (accepted = rejection_sample's output)."""
        for nd, out in zip(num_draft, accepted, strict=True):
            if nd:
                self.num_drafts += 1
                self.num_draft_tokens += nd
                self.num_accepted += len(out) - 1  # the last token is the target's own


def rejection_sample(
    target_logits: Tensor,
    draft_token_ids: Tensor,
    num_draft: Sequence[int],
    batch: SamplingBatch,
    *,
    draft_probs: Tensor | None = None,
    allowed_token_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Verify drafts against the target and return each request's emitted tokens.

    target_logits: `[B, K+1, V]` raw target logits; position j scores the token after the
        request's tokens plus draft[:j]. The full sampling pipeline (penalties seeing the
        drafts, min_tokens, mask, temperature, top-k/p, min-p) is applied here per position.
    draft_token_ids: `[B, K]`; only the first num_draft[b] of row b are real drafts.
    draft_probs: `[B, K, V]` draft distributions q, or None for deterministic drafts (n-gram),
        i.e. one-hot q at the draft token.
    allowed_token_mask: `[B, K+1, V]` structured-output mask per position, if any.

    Greedy rows accept drafts while they equal the argmax and then emit the argmax, so their
    output equals plain greedy decoding. Sampled rows accept draft x with prob
    min(1, p(x)/q(x)); at the first rejection they sample from norm(max(p - q, 0)) (for one-hot
    q: p without x, renormalized); if all are accepted they sample the bonus from p at
    position num_draft[b]. Seeded rows draw from their own generator (not batch-dependent, but
    a different random stream than non-speculative decoding uses).
    """
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    if draft_token_ids.shape != (b, k) or len(num_draft) != b:
        raise ValueError("draft_token_ids must be [B, K] and num_draft must have B entries")
    device = target_logits.device
    nd = torch.as_tensor(list(num_draft), device=device)
    real = torch.arange(k, device=device).unsqueeze(0) < nd.unsqueeze(1)  # [B, K]
    # Padding past num_draft may hold anything (e.g. -1); make it a valid index.
    drafts = draft_token_ids.to(device=device, dtype=torch.long).masked_fill(~real, 0)
    wide = batch.expand_for_spec(drafts, num_draft, allowed_token_mask)
    x = prepare_logits(target_logits.reshape(b * k1, vocab), wide)
    argmax = row_argmax(x).view(b, k1)

    if batch.all_greedy:
        accept = drafts == argmax[:, :k]
    else:
        probs = sampling_probs(x, wide).view(b, k1, vocab)
        p_draft = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
        if draft_probs is not None:
            q_draft = draft_probs.to(device).gather(2, drafts.unsqueeze(2)).squeeze(2)
            ratio = (p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)).clamp(max=1.0)
        else:
            ratio = p_draft
        uniform, expo = _draw(batch, num_draft, k, vocab, device, generator)
        accept = torch.where(batch.greedy.unsqueeze(1), drafts == argmax[:, :k], uniform < ratio)
    # Accepted prefix length: stop at the first rejected real draft.
    ok = (accept & real).to(torch.long)
    n_acc = ok.cumprod(dim=1).sum(dim=1)  # [B]
    final = argmax.gather(1, n_acc.unsqueeze(1)).squeeze(1)

    if not batch.all_greedy:
        rows = torch.arange(b, device=device)
        p = probs[rows, n_acc]  # [B, V] target distribution at the stopping position
        rejected = n_acc < nd
        at = n_acc.clamp(max=max(k - 1, 0))
        if draft_probs is not None and k:
            q = draft_probs.to(device)[rows, at]
        else:
            q = torch.zeros_like(p)
            if k:
                q.scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        residual = (p - q).clamp_min(0.0)
        # p == q exactly leaves no residual mass; then p itself is the right fallback.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        dist = torch.where(rejected.unsqueeze(1), residual, p)
        sampled = exponential_race(dist / dist.sum(dim=1, keepdim=True), expo)
        final = torch.where(batch.greedy, final, sampled)

    n_list, d_list, f_list = n_acc.tolist(), drafts.tolist(), final.tolist()
    return [d_list[i][: n_list[i]] + [f_list[i]] for i in range(b)]


def _draw(
    batch: SamplingBatch,
    num_draft: Sequence[int],
    k: int,
    vocab: int,
    device: torch.device,
    shared: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Uniforms `[B, K]` for acceptance and Exp(1) `[B, V]` for the one sampled token per row.
    A seeded row draws num_draft[r] uniforms then V exponentials from its own generator, so its
    stream does not depend on the batch's K."""
    b = len(num_draft)
    uniform = torch.rand(b, k, device=device, generator=shared)
    expo = torch.empty(b, vocab, device=device).exponential_(generator=shared)
    for r in batch.seeded_rows:
        gen = batch.generators[r]
        if num_draft[r]:
            uniform[r, : num_draft[r]].uniform_(generator=gen)
        expo[r].exponential_(generator=gen)
    return uniform, expo
