"""The batched Sampler.

Pipeline per step (all rows at once):
  logit_bias -> penalties -> bans (min_tokens stop ids, structured-output mask) -> greedy rows: argmax
  -> temperature -> top-k -> top-p -> min-p -> sample (exponential race).

Logprobs are the log_softmax of the RAW logits the model produced, before penalties, masks,
temperature and truncation (vLLM's default "raw_logprobs"): they describe the model, not the
sampling policy, and stay comparable across requests with different sampling settings.

Determinism: a row with its own torch.Generator draws its Exp(1) noise from that generator
alone, so its token does not depend on which other rows share the batch. Rows without one
share the Sampler's generator (or torch's global RNG).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import SamplingBatch
from .processors import (
    NEG_INF,
    apply_frequency_presence_penalties,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
    exponential_race,
    row_argmax,
)


@dataclass(slots=True)
class LogprobsTensors:
    sampled_logprobs: Tensor  # [B] logprob of the sampled token
    sampled_ranks: Tensor  # [B] 1-based rank of the sampled token in the raw distribution
    topk_ids: Tensor  # [B, n] with n = max logprobs asked in the batch (rows slice their own)
    topk_logprobs: Tensor  # [B, n]

    def row(self, i: int, n: int) -> tuple[float, int, list[tuple[int, float]]]:
        """(sampled logprob, rank, top-n (id, logprob)) for row i."""
        top = list(zip(self.topk_ids[i, :n].tolist(), self.topk_logprobs[i, :n].tolist(), strict=True))
        return float(self.sampled_logprobs[i]), int(self.sampled_ranks[i]), top


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


def prepare_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Logit bias, penalties, then bans, on a copy: the logits greedy rows take the argmax of."""
    x = logits.to(torch.float32, copy=True)
    if batch.logit_bias is not None:
        x += batch.logit_bias
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        apply_repetition_penalty(x, seen, batch.repetition_penalty)
    if batch.frequency_penalty is not None:
        apply_frequency_presence_penalties(
            x, batch.output_counts, batch.frequency_penalty, batch.presence_penalty
        )
    ban = None
    if batch.stop_mask is not None:
        ban = batch.stop_mask & (batch.min_tokens_left > 0).unsqueeze(1)
    if batch.allowed_token_mask is not None:
        allowed = batch.allowed_token_mask
        if ban is not None:
            # If the grammar allows only stop tokens, the grammar wins over min_tokens:
            # banning them would leave the row with nothing to sample.
            keeps_some = (allowed & ~ban).any(dim=1, keepdim=True)
            allowed = allowed & ~(ban & keeps_some)
        x.masked_fill_(~allowed, NEG_INF)
    elif ban is not None:
        x.masked_fill_(ban, NEG_INF)
    return x


def sampling_probs(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, top-k, top-p, min-p, softmax over prepared logits (consumes x)."""
    x = apply_temperature(x, batch.temperature)
    x = apply_top_k_top_p(x, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        x = apply_min_p(x, batch.min_p)
    return x.softmax(dim=1)


def draw_exponentials(
    batch: SamplingBatch, rows: int, vocab: int, device: torch.device, shared: torch.Generator | None
) -> Tensor:
    """`[rows, vocab]` Exp(1) noise; seeded rows draw from their own generator only."""
    q = torch.empty(rows, vocab, device=device).exponential_(generator=shared)
    for r in batch.seeded_rows:  # only rows that asked for a seed pay the python loop
        q[r].exponential_(generator=batch.generators[r])
    return q


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # shared RNG for unseeded rows; None = torch global RNG

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.size, batch.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} != [{batch.size}, {batch.vocab_size}]")
        if batch.all_greedy and not batch.modifies_logits:
            x = logits  # nothing to apply: argmax of the raw logits, no [B, V] copy
        else:
            x = prepare_logits(logits, batch)
        tokens = row_argmax(x)
        if not batch.all_greedy:
            probs = sampling_probs(x, batch)
            q = draw_exponentials(batch, *probs.shape, probs.device, self.generator)
            tokens = torch.where(batch.greedy, tokens, exponential_race(probs, q))
        lp = None
        if batch.max_num_logprobs is not None:
            lp = compute_logprobs(logits, tokens, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=tokens, logprobs=lp)


def compute_logprobs(raw_logits: Tensor, tokens: Tensor, n: int) -> LogprobsTensors:
    logprobs = raw_logits.float().log_softmax(dim=1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=1) + 1
    top = logprobs.topk(n, dim=1)
    return LogprobsTensors(
        sampled_logprobs=sampled.squeeze(1),
        sampled_ranks=ranks,
        topk_ids=top.indices,
        topk_logprobs=top.values,
    )
