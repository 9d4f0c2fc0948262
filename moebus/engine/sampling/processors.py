"""Batched logits processors: pure torch functions over float32 logits.

The truncations (top-k, top-p, min-p) take `[B, V]` logits and per-row parameter tensors (`[B]`)
where a neutral value means "off" for that row (top_k >= V, top_p = 1, min_p = 0), so one call
serves a mixed batch with no per-row python loop; they leave the logits alone and give one floor
per row (truncation_floor) that the sampler applies. The penalties take only the logits of the
tokens a row has seen (batch.SeenTokens) with each one's row parameters, and return new values.
"""
from __future__ import annotations

import torch
from torch import Tensor

# argmax over dim 1 (the first maximum, NaN wins). Its torch reference is max().indices, faster
# than argmax on CPU in torch 2.13; the C kernel is faster again (rows in parallel, vectorised).
from moebus import platforms
from moebus.kernels import row_argmax
from moebus.kernels.sample import softmax_mass

NEG_INF = float("-inf")


def apply_repetition_penalty(values: Tensor, penalty: Tensor) -> Tensor:
    """HF semantics, on the logits of seen tokens (prompt or output) and each one's row penalty:
    positive logits divided by the penalty, negative ones multiplied, so a penalty > 1 always makes
    a seen token less likely."""
    return torch.where(values > 0, values / penalty, values * penalty)


def apply_frequency_presence_penalties(values: Tensor, counts: Tensor, frequency: Tensor,
                                       presence: Tensor) -> Tensor:
    """OpenAI semantics, over generated tokens only: logit - frequency * count - presence * (count > 0),
    on the logits of seen tokens with their counts and row penalties (an unseen token's logit would
    lose 0)."""
    values = values - frequency * counts
    return values - presence * (counts > 0).to(values.dtype)


def truncation_floor(x: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                     min_p: Tensor | None) -> Tensor:
    """`[B]` float32: the smallest logit each row keeps (-inf: all) under top-k, then top-p over the
    top-k survivors, then min-p, all at the row's temperature. Each keeps the logits at or above a
    value, so their sequence keeps those at or above the greatest of the three:

    top-k: the k-th largest logit; ties with it are all kept (top_k >= V: off).
    top-p: the smallest prefix of the survivors by descending probability whose mass reaches top_p;
        ties with its last logit are all kept (top_p 1: off).
    min-p: probability >= min_p * the top token's, i.e. x >= max + T * log(min_p) (0: off).

    Why a floor and not a masked [B, V] copy: the sampler's kernel takes it as is (no copy, no full
    sort). On CPU top-p's floor comes from kernels.sample.top_p_floor (a histogram of the mass, no
    sort: a sort-based top-p 0.95 made a 64-row SmolLM2 step far slower than a greedy one); elsewhere it sorts
    the largest logits, widening while the prefix runs past them.
    """
    b, vocab = x.shape
    floor = x.new_full((b,), NEG_INF, dtype=torch.float32)
    m = x.amax(dim=1)
    k = top_k.clamp(max=vocab) if top_k is not None else torch.full((b,), vocab, device=x.device)
    p = top_p if top_p is not None else torch.ones(b, device=x.device)
    if bool(((k < vocab) | (p < 1)).any()):
        floor = _top_k_top_p_floor(x, m, temperature, k, p)
    if min_p is not None:
        floor = torch.maximum(floor, m + temperature * min_p.log())  # log(0) = -inf: off
    return floor


def _top_k_top_p_floor(x: Tensor, m: Tensor, temperature: Tensor, k: Tensor, p: Tensor) -> Tensor:
    x, m = x.float(), m.float()
    vocab = x.shape[1]
    top_k_rows = k < vocab
    kth = x.new_full(k.shape, NEG_INF)
    if bool(top_k_rows.any()):
        c = int(k[top_k_rows].max())
        vals = x.topk(c, dim=1).values  # descending
        kth = torch.where(top_k_rows, vals.gather(1, (k - 1).clamp(max=c - 1).unsqueeze(1)).squeeze(1), NEG_INF)
    if not bool((p < 1).any()):
        return kth
    floor = platforms.of(x).top_p_floor(x, temperature, p, kth)  # the CPU's: no sort of the rows
    return floor if floor is not None else _top_p_floor_by_topk(x, m, temperature, kth, p)


def _top_p_floor_by_topk(x: Tensor, m: Tensor, temperature: Tensor, kth: Tensor, p: Tensor) -> Tensor:
    """top_p_floor off the CPU: sorts the C largest logits (C = 64 at first) and widens C 8x while a
    prefix runs past them, up to a full sort of the rows."""
    vocab = x.shape[1]
    c = 64
    # Rows whose max is not finite are left to the sampler's argmax: no floor needed.
    settled = ~m.isfinite() | (p >= 1)
    shift = torch.where(settled, 0.0, m).unsqueeze(1)
    t = temperature.unsqueeze(1)
    while True:
        c = min(c, vocab)
        vals = x.topk(c, dim=1).values  # descending
        # Probabilities over the top-k survivors (ties past the C sorted ones included in the sum).
        z = softmax_mass(x, shift.squeeze(1), temperature, kth).unsqueeze(1).float()
        probs = (((vals - shift) / t).exp() / z).masked_fill(vals < kth.unsqueeze(1), 0.0)
        cum = probs.cumsum(dim=1)
        kept = ((cum - probs) < p.unsqueeze(1)).sum(dim=1).clamp(min=1)  # prefix length, top token kept
        last = vals.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        # Every logit past the C sorted ones has mass before it >= cum[:, -1]: dropped if that reached p.
        done = settled | (cum[:, -1] >= p) | (c == vocab)
        if bool(done.all()):
            return torch.maximum(kth, torch.where(p < 1, last, NEG_INF))
        c *= 8


def exponential_race(probs: Tensor, q: Tensor) -> Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exp(1) is distributed as p
    (the Gumbel-max trick in another form). Zero q would give 0/0 = NaN, which argmax
    picks, so it is clamped away."""
    return row_argmax(probs / q.clamp_min_(torch.finfo(q.dtype).tiny))
