"""Batched logits processors: pure torch functions over `[B, V]` float32 logits.

Each takes per-row parameter tensors (shape `[B]`) where a neutral value means "off" for that
row (penalty 0 / 1, top_k >= V, top_p = 1, min_p = 0), so one call serves a mixed batch with no
per-row python loop. All of them return a new tensor or modify `logits` in place as noted.
"""
from __future__ import annotations

import torch
from torch import Tensor

# argmax over dim 1 (the first maximum, NaN wins). Its torch reference is max().indices, 2.5-5x
# faster than argmax on CPU in torch 2.13; the C kernel is ~9x faster again on [64, 49152] fp32.
from moebus.kernels import row_argmax

NEG_INF = float("-inf")


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """HF semantics (in place): for tokens seen in prompt+output, divide positive logits by the
    penalty and multiply negative ones, so a penalty > 1 always makes a seen token less likely."""
    p = penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return logits.copy_(torch.where(seen, penalized, logits))


def apply_frequency_presence_penalties(
    logits: Tensor, output_counts: Tensor, frequency: Tensor, presence: Tensor
) -> Tensor:
    """OpenAI semantics (in place), over generated tokens only:
    logit -= frequency * count + presence * (count > 0)."""
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """In place. Greedy rows must carry temperature 1 here (they never use the result)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Keep the k largest logits (ties at the k-th value are all kept), then the smallest
    prefix of the remaining tokens, by descending probability, whose mass reaches top_p.

    top_k: `[B]` int64, values >= V mean off. top_p: `[B]` float, 1.0 means off.
    Returns a new tensor; masked entries are -inf.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    if top_p is None:
        # topk of the largest k in use is cheaper than a full sort.
        k = top_k.clamp(max=vocab)
        kmax = int(k.max())
        kth = logits.topk(kmax, dim=1).values.gather(1, (k - 1).clamp(max=kmax - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= vocab).unsqueeze(1), NEG_INF)
        return logits.masked_fill(logits < kth, NEG_INF)

    sorted_logits, order = logits.sort(dim=1, descending=True)
    if top_k is not None:
        k = top_k.clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # exclusive prefix sum
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    # cumsum can round to >= 1 before the tail: rows with top_p == 1 must drop nothing.
    drop &= (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p * (probability of the top token).
    Comparing logits avoids a softmax: p_i < m * p_max  <=>  l_i < l_max + log(m)."""
    threshold = logits.amax(dim=1, keepdim=True) + min_p.unsqueeze(1).log()  # log(0) = -inf: off
    return logits.masked_fill(logits < threshold, NEG_INF)


def exponential_race(probs: Tensor, q: Tensor) -> Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exp(1) is distributed as p
    (the Gumbel-max trick in another form). Zero q would give 0/0 = NaN, which argmax
    picks, so it is clamped away."""
    return row_argmax(probs / q.clamp_min_(torch.finfo(q.dtype).tiny))
