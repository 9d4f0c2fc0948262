"""The batched Sampler.

Pipeline per step (all rows at once):
  logit_bias -> penalties -> bans (min_tokens stop ids, structured-output mask) -> greedy rows: argmax
  -> temperature, top-k -> top-p -> min-p as one floor per row (processors.truncation_floor) ->
  sample (kernels.sample_logits: inverse CDF of the truncated softmax, one uniform per row).

No [B, V] copy (unless penalties, bias or bans apply), softmax, sort or noise: sample_logits takes
the logits with each row's temperature and floor, and greedy rows go through it as temperature 0
(their argmax).

Logprobs are the log_softmax of the RAW logits the model produced, before penalties, masks,
temperature and truncation (vLLM's default "raw_logprobs"): they describe the model, not the
sampling policy, and stay comparable across requests with different sampling settings.

Determinism: a row with its own torch.Generator draws its one float64 uniform per step from that
generator alone (`draw_uniforms`), and its token is a function of its logits and that uniform, so
it does not depend on which other rows share the batch. Rows without one share the Sampler's
generator (or torch's global RNG).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moebus.kernels import sample_logits

from .batch import SamplingBatch
from .processors import (
    NEG_INF,
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    row_argmax,
    truncation_floor,
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
    if batch.seen is not None:  # the penalties, on the seen tokens' logits only
        s = batch.seen
        values = x[s.rows, s.ids]
        if batch.repetition_penalty is not None:
            values = apply_repetition_penalty(values, batch.repetition_penalty[s.rows])
        if batch.frequency_penalty is not None:
            values = apply_frequency_presence_penalties(values, s.counts, batch.frequency_penalty[s.rows],
                                                        batch.presence_penalty[s.rows])
        x[s.rows, s.ids] = values
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


def sampling_floor(x: Tensor, batch: SamplingBatch) -> Tensor:
    """`[B]` the smallest logit each sampled row keeps (truncation_floor); greedy rows keep all."""
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        return x.new_full((batch.size,), NEG_INF, dtype=torch.float32)
    greedy = batch.greedy
    return truncation_floor(
        x, batch.temperature,
        None if batch.top_k is None else batch.top_k.masked_fill(greedy, batch.vocab_size),
        None if batch.top_p is None else batch.top_p.masked_fill(greedy, 1.0),
        None if batch.min_p is None else batch.min_p.masked_fill(greedy, 0.0),
    )


def sampling_probs(x: Tensor, batch: SamplingBatch) -> Tensor:
    """The distribution sampled rows draw from: softmax of x / T over the logits at or above the floor."""
    keep = x >= sampling_floor(x, batch).unsqueeze(1)
    return (x / batch.temperature.unsqueeze(1)).masked_fill(~keep, NEG_INF).softmax(dim=1)


def draw_uniforms(batch: SamplingBatch, device: torch.device, shared: torch.Generator | None) -> Tensor:
    """`[B]` float64 U[0, 1), one per row; a seeded row draws its own from its generator only."""
    u = torch.rand(batch.size, dtype=torch.float64, device=device, generator=shared)
    for r in batch.seeded_rows:  # only rows that asked for a seed pay the python loop
        u[r : r + 1].uniform_(generator=batch.generators[r])
    return u


def advance_generator(generator: torch.Generator, tokens: int) -> None:
    """Advance a seeded request's generator by the draws `tokens` sampled tokens take (one uniform
    each, as draw_uniforms), e.g. when a migrated request resumes after tokens sampled elsewhere."""
    u = torch.empty(1, dtype=torch.float64, device=generator.device)
    for _ in range(tokens):
        u.uniform_(generator=generator)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # shared RNG for unseeded rows; None = torch global RNG

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.size, batch.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} != [{batch.size}, {batch.vocab_size}]")
        # Nothing to apply: sample or take the argmax of the raw logits, no [B, V] copy.
        x = prepare_logits(logits, batch) if batch.modifies_logits else logits
        if batch.all_greedy:
            tokens = row_argmax(x)
        else:
            temperature = batch.temperature.masked_fill(batch.greedy, 0.0)  # 0: the row's argmax
            u = draw_uniforms(batch, x.device, self.generator)
            tokens = sample_logits(x, temperature, u, sampling_floor(x, batch))
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
