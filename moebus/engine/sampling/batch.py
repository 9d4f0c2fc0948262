"""SamplingBatch: the per-row tensors the Sampler needs, built once per step from requests."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator the engine keeps for a seeded request across its steps."""
    return torch.Generator(device=device).manual_seed(seed)


def _pad(rows: Sequence[Sequence[int]], fill: int, device: torch.device) -> Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def _counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """`[B, V]` float32 token counts; padding goes to an extra column that is dropped."""
    ids = _pad(rows, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


@dataclass(frozen=True, slots=True)
class SeenTokens:
    """The (row, token) pairs the penalties touch: tokens a row generated (frequency, presence,
    repetition) or, where the repetition penalty is on, has in its prompt. Sorted by row, then token.

    Why not [B, V] tensors: building a count matrix and a prompt mask each step and applying the
    penalties over every logit made penalties cost as much as a 16-row step's sampling; a row has
    seen a few hundred of SmolLM2's 49152 tokens."""

    rows: Tensor  # [S] int64
    ids: Tensor  # [S] int64
    counts: Tensor  # [S] float32: times the row generated the token (0: in its prompt only)
    in_prompt: Tensor  # [S] bool

    @classmethod
    def merge(cls, rows: Tensor, ids: Tensor, counts: Tensor, in_prompt: Tensor, vocab_size: int) -> SeenTokens:
        """One entry per distinct (row, token) of the given entries, counts added, in_prompt or-ed."""
        keys, inverse = torch.unique(rows * vocab_size + ids, return_inverse=True)
        total = torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device).index_add_(0, inverse, counts)
        prompt = torch.zeros(keys.shape[0], dtype=torch.int32, device=keys.device).index_add_(
            0, inverse, in_prompt.to(torch.int32))
        return cls(keys // vocab_size, keys % vocab_size, total, prompt > 0)

    @classmethod
    def of(cls, outputs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]] | None, vocab_size: int,
           device: torch.device) -> SeenTokens:
        """From each row's output ids and, for the repetition penalty, its prompt ids (ids outside
        [0, vocab_size) dropped)."""
        rows, ids = _row_keys(outputs, vocab_size)
        counts, in_prompt = torch.ones(len(ids)), torch.zeros(len(ids), dtype=torch.bool)
        if prompts is not None:  # prompt entries count 0 generated tokens
            p_rows, p_ids = _row_keys(prompts, vocab_size)
            rows, ids = torch.cat([rows, p_rows]), torch.cat([ids, p_ids])
            counts = torch.cat([counts, torch.zeros(len(p_ids))])
            in_prompt = torch.cat([in_prompt, torch.ones(len(p_ids), dtype=torch.bool)])
        return cls.merge(rows, ids, counts, in_prompt, vocab_size).to(device)

    def to(self, device: torch.device) -> SeenTokens:
        return SeenTokens(*(t.to(device) for t in (self.rows, self.ids, self.counts, self.in_prompt)))


def _row_keys(rows: Sequence[Sequence[int]], vocab_size: int) -> tuple[Tensor, Tensor]:
    """(row index, token id) of every id in `rows` that lies in [0, vocab_size)."""
    ids = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    flat = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(t) for t in ids], dtype=torch.long))
    ok = (flat >= 0) & (flat < vocab_size)
    return row[ok], flat[ok]


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    return [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def takes_raw_argmax(params: Sequence[SamplingParams], num_outputs: Sequence[int],
                     eos_token_id: int | Sequence[int] | None = None, masked: bool = False) -> bool:
    """Whether every row's token is the argmax of its raw logits, i.e. the batch `build` gives has
    all_greedy, nothing for prepare_logits to do and no logprobs, decided without building it (a
    fast path may then skip the logits). Conservative: False whenever a stop id could be banned."""
    if masked:
        return False
    eos = _eos_ids(eos_token_id)
    for p, n in zip(params, num_outputs, strict=True):
        if (not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.logit_bias):
            return False
        if p.min_tokens > n and (p.stop_token_ids or (eos and not p.ignore_eos)):
            return False
    return True


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for one step. Optional tensors are None when no row uses the
    feature, so the Sampler skips it entirely. Neutral values mark rows that don't use it."""

    vocab_size: int
    greedy: Tensor  # [B] bool
    all_greedy: bool
    temperature: Tensor  # [B] float32; 1.0 on greedy rows so division is harmless
    top_k: Tensor | None  # [B] int64; >= vocab_size = off
    top_p: Tensor | None  # [B] float32; 1.0 = off
    min_p: Tensor | None  # [B] float32; 0.0 = off
    repetition_penalty: Tensor | None  # [B] float32; 1.0 = off
    frequency_penalty: Tensor | None  # [B] float32
    presence_penalty: Tensor | None  # [B] float32
    seen: SeenTokens | None  # the tokens the penalties touch (any penalty on)
    min_tokens_left: Tensor | None  # [B] int64: tokens still to emit before a stop is allowed
    stop_mask: Tensor | None  # [B, V] bool: the row's stop/eos ids (banned while left > 0)
    allowed_token_mask: Tensor | None  # [B, V] bool (structured output); False -> -inf
    logit_bias: Tensor | None  # [B, V] float32 added to the raw logits (OpenAI logit_bias); 0 = none
    generators: list[torch.Generator | None]
    seeded_rows: list[int]  # rows that are not greedy and have a generator
    num_logprobs: list[int | None]
    max_num_logprobs: int | None  # None when no row asks for logprobs

    @property
    def size(self) -> int:
        return self.greedy.shape[0]

    @property
    def modifies_logits(self) -> bool:
        """Whether prepare_logits has anything to do (penalties, bans, a grammar mask)."""
        return (self.repetition_penalty is not None or self.frequency_penalty is not None
                or self.stop_mask is not None or self.allowed_token_mask is not None or self.logit_bias is not None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        allowed_token_mask: Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> SamplingBatch:
        """eos_token_id: the model's eos id(s). While a row has generated fewer than
        `min_tokens`, its eos (unless ignore_eos) and its stop_token_ids are banned."""
        device = torch.device(device)
        n = len(params)
        if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == n):
            raise ValueError("params, output_token_ids, prompt_token_ids, generators differ in length")

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        use_top_k = any(not g and k < vocab_size for g, k in zip(greedy, top_k, strict=True))
        use_top_p = any(not g and p.top_p < 1.0 for g, p in zip(greedy, params, strict=True))
        use_min_p = any(not g and p.min_p > 0.0 for g, p in zip(greedy, params, strict=True))
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)

        eos = _eos_ids(eos_token_id)
        left = [max(p.min_tokens - len(out), 0) for p, out in zip(params, output_token_ids, strict=True)]
        min_tokens_left = stop_mask = None
        if any(left):
            min_tokens_left = col(left, torch.long)
            stops = [
                [t for t in (p.stop_token_ids + ([] if p.ignore_eos else eos)) if 0 <= t < vocab_size]
                for p in params
            ]
            if any(s for s, n in zip(stops, left, strict=True) if n):  # else nothing to ban: skip [B, V]
                stop_mask = _counts(stops, vocab_size, device) > 0

        seen = None
        if use_freq or use_rep:
            seen = SeenTokens.of(output_token_ids, prompt_token_ids if use_rep else None, vocab_size, device)
        if allowed_token_mask is not None:
            if allowed_token_mask.shape != (n, vocab_size) or allowed_token_mask.dtype != torch.bool:
                raise ValueError(f"allowed_token_mask must be bool [{n}, {vocab_size}]")
            allowed_token_mask = allowed_token_mask.to(device)

        logit_bias = None
        if any(p.logit_bias for p in params):  # ids past the model's vocab are dropped
            logit_bias = torch.zeros(n, vocab_size, dtype=torch.float32)
            for i, p in enumerate(params):
                ids = [t for t in p.logit_bias if 0 <= t < vocab_size]
                if ids:
                    logit_bias[i, ids] = torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32)
            logit_bias = logit_bias.to(device)

        logprobs = [p.logprobs for p in params]
        asked = [x for x in logprobs if x is not None]
        return cls(
            vocab_size=vocab_size,
            greedy=col(greedy, torch.bool),
            all_greedy=all(greedy),
            temperature=col([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]),
            top_k=col(top_k, torch.long) if use_top_k else None,
            top_p=col([p.top_p for p in params]) if use_top_p else None,
            min_p=col([p.min_p for p in params]) if use_min_p else None,
            repetition_penalty=col([p.repetition_penalty for p in params]) if use_rep else None,
            frequency_penalty=col([p.frequency_penalty for p in params]) if use_freq else None,
            presence_penalty=col([p.presence_penalty for p in params]) if use_freq else None,
            seen=seen,
            min_tokens_left=min_tokens_left,
            stop_mask=stop_mask,
            allowed_token_mask=allowed_token_mask,
            logit_bias=logit_bias,
            generators=list(generators),
            seeded_rows=[i for i, (g, gen) in enumerate(zip(greedy, generators, strict=True)) if not g and gen],
            num_logprobs=logprobs,
            max_num_logprobs=max(asked) if asked else None,
        )

    def expand_for_spec(
        self, draft_token_ids: Tensor, num_draft: Sequence[int], allowed_token_mask: Tensor | None = None
    ) -> SamplingBatch:
        """The batch of B*(K+1) rows for verifying K drafts: row (b, j) is request b after it
        has also emitted draft_token_ids[b, :j], so penalties and min_tokens see the drafts.

        allowed_token_mask: `[B, K+1, V]` bool per position (the grammar advanced through the
        drafts); required when this batch has a structured-output mask.
        """
        b, k = draft_token_ids.shape
        device = self.greedy.device
        pos = torch.arange(k + 1, device=device)

        def rep(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.repeat_interleave(k + 1, dim=0)

        seen = None
        if self.seen is not None:
            s = self.seen
            nd = torch.as_tensor(list(num_draft), device=device)
            real = pos[None, :k] < nd[:, None]  # [B, K]
            # draft j counts at positions p > j, and only if it is a real draft (j < num_draft).
            at = ((pos[None, :, None] > pos[None, None, :k]) & real[:, None, :]).nonzero()  # (b, p, j)
            drafts = draft_token_ids.to(device=device, dtype=torch.long)[at[:, 0], at[:, 2]]
            seen = SeenTokens.merge(
                torch.cat([(s.rows[:, None] * (k + 1) + pos).reshape(-1), at[:, 0] * (k + 1) + at[:, 1]]),
                torch.cat([s.ids.repeat_interleave(k + 1), drafts]),
                torch.cat([s.counts.repeat_interleave(k + 1), torch.ones(len(drafts), device=device)]),
                torch.cat([s.in_prompt.repeat_interleave(k + 1), torch.zeros(len(drafts), dtype=torch.bool,
                                                                              device=device)]),
                self.vocab_size)
        left = None
        if self.min_tokens_left is not None:
            left = (self.min_tokens_left.unsqueeze(1) - pos).clamp_min(0).reshape(-1)
        if allowed_token_mask is not None:
            allowed_token_mask = allowed_token_mask.to(device).reshape(b * (k + 1), -1)
        elif self.allowed_token_mask is not None:
            raise ValueError("structured rows need a per-position allowed_token_mask [B, K+1, V]")
        return dataclasses.replace(
            self,
            greedy=rep(self.greedy),
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            repetition_penalty=rep(self.repetition_penalty),
            frequency_penalty=rep(self.frequency_penalty),
            presence_penalty=rep(self.presence_penalty),
            seen=seen,
            min_tokens_left=left,
            stop_mask=rep(self.stop_mask),
            allowed_token_mask=allowed_token_mask,
            logit_bias=rep(self.logit_bias),
            # The rejection sampler draws its own randomness per request, not per expanded row.
            generators=[g for g in self.generators for _ in range(k + 1)],
            seeded_rows=[r * (k + 1) + j for r in self.seeded_rows for j in range(k + 1)],
            num_logprobs=[x for x in self.num_logprobs for _ in range(k + 1)],
        )
