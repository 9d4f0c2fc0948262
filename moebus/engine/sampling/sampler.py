"""The batched Sampler.

Pipeline per step (all rows at once):
  logit_bias -> penalties -> bans (min_tokens stop ids, structured-output mask) -> greedy rows: argmax
  -> temperature -> top-k -> top-p -> min-p -> sample (kernels.sample_logits: inverse CDF of the
  softmax, one uniform per row).

Rows that only sample at a temperature (no top-k/top-p/min-p: the OpenAI API default) skip the
[B, V] copy, the softmax and all [B, V] noise: sample_logits takes the (prepared) logits and the
temperatures directly, and greedy rows in the batch go through it as temperature 0 (their argmax).

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
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k_top_p,
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


def truncated_logits(x: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, top-k, top-p, min-p over prepared logits (consumes x); dropped tokens are -inf."""
    x = apply_temperature(x, batch.temperature)
    x = apply_top_k_top_p(x, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        x = apply_min_p(x, batch.min_p)
    return x


def sampling_probs(x: Tensor, batch: SamplingBatch) -> Tensor:
    """The distribution sampled rows draw from (consumes x)."""
    return truncated_logits(x, batch).softmax(dim=1)


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
        elif batch.top_k is None and batch.top_p is None and batch.min_p is None:
            temperature = batch.temperature.masked_fill(batch.greedy, 0.0)  # 0: the row's argmax
            tokens = sample_logits(x, temperature, draw_uniforms(batch, x.device, self.generator))
        else:
            if x is logits:
                x = logits.to(torch.float32, copy=True)  # truncation works in place
            greedy = row_argmax(x)
            y = truncated_logits(x, batch)
            u = draw_uniforms(batch, x.device, self.generator)
            tokens = torch.where(batch.greedy, greedy, sample_logits(y, torch.ones_like(batch.temperature), u))
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
