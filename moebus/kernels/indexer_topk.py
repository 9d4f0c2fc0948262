"""Lightning-indexer top-k of DeepSeek-V4 compressed sparse attention (HF DeepseekV4Indexer).

For query row r with heads q[r, h] [D] and head weights w[r, h], over the compressed keys of its
own sequence `keys[start[r] : start[r] + n_visible[r]]`:

    score[r, e] = sum_h w[r, h] * relu(q[r, h] . keys[start[r] + e]) * scale

Returns [R, k] int64: the top-k entries e (relative to start[r]) by descending score, ties to the
lower e; -1 fills the row when fewer than k are visible. Scores in float32. The keys of all
sequences are one flat tensor, so a batch of decodes is one call.
"""
from __future__ import annotations

import torch

from ._compat import check_launchable, next_pow2, tl, triton, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, PTR, PTR, PTR, PTR, PTR, I64, I32, I32, I32, F32]


def _check(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
           n_visible: torch.Tensor) -> None:
    assert q.dim() == 3 and weights.shape == q.shape[:2], (q.shape, weights.shape)
    assert keys.dim() == 2 and keys.shape[1] == q.shape[2], (keys.shape, q.shape)
    assert start.shape == n_visible.shape == q.shape[:1], (start.shape, n_visible.shape)


def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k columns of masked scores [R, E] (-inf = not visible), ties to the lower column."""
    r, e = scores.shape
    out = torch.full((r, k), -1, dtype=torch.long, device=scores.device)
    if e == 0 or r == 0:
        return out
    # A stable descending sort keeps equal scores in column order; then drop the -inf tail.
    vals, idx = scores.sort(dim=1, descending=True, stable=True)
    kk = min(k, e)
    out[:, :kk] = torch.where(vals[:, :kk] > float("-inf"), idx[:, :kk], -1)
    return out


def _masked_scores_ref(q, weights, keys, start, n_visible, scale) -> torch.Tensor:
    e_max = int(n_visible.max()) if n_visible.numel() else 0
    cols = torch.arange(e_max, device=q.device)
    visible = cols[None, :] < n_visible[:, None]
    idx = (start[:, None] + cols[None, :]).clamp(max=max(keys.shape[0] - 1, 0))
    if keys.shape[0] == 0:
        return q.new_full((q.shape[0], e_max), float("-inf"), dtype=torch.float32)
    dots = torch.einsum("rhd,red->rhe", q.float(), keys[idx].float()).relu() * scale
    scores = (dots * weights.float()[:, :, None]).sum(dim=1)
    return scores.masked_fill(~visible, float("-inf"))


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                     n_visible: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    _check(q, weights, keys, start, n_visible)
    return _select(_masked_scores_ref(q, weights, keys, start, n_visible, scale), k)


@triton.jit
def _score_kernel(q_ptr, w_ptr, keys_ptr, start_ptr, nvis_ptr, out_ptr, H, D, E_MAX, scale,
                  BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (r, eb): BLOCK_E entries of row r; heads are summed one at a time.
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.arange(0, BLOCK_D)
    nvis = tl.load(nvis_ptr + r)
    first = tl.load(start_ptr + r)
    visible = e < nvis
    k = tl.load(keys_ptr + (first + e)[:, None] * D + d[None, :],
                mask=visible[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h in range(H):
        qh = tl.load(q_ptr + (r * H + h) * D + d, mask=d < D, other=0.0).to(tl.float32)
        s = tl.maximum(tl.sum(k * qh[None, :], axis=1), 0.0) * scale
        acc += s * tl.load(w_ptr + r * H + h).to(tl.float32)
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(out_ptr + r * E_MAX + e, acc, mask=e < E_MAX)


def indexer_topk_triton(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                        n_visible: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    """Scores in Triton, selection with torch's stable sort."""
    _check(q, weights, keys, start, n_visible)
    check_launchable(q, weights, keys, start, n_visible)
    q, weights, keys = q.contiguous(), weights.contiguous(), keys.contiguous()
    r, h, d = q.shape
    e_max = int(n_visible.max()) if r else 0
    scores = torch.empty(r, e_max, dtype=torch.float32, device=q.device)
    if r and e_max:
        block_e = min(next_pow2(e_max), 64)
        _score_kernel[(r, triton.cdiv(e_max, block_e))](
            q, weights, keys, start.long().contiguous(), n_visible.long().contiguous(), scores, h, d, e_max,
            scale, BLOCK_E=block_e, BLOCK_D=next_pow2(d))
    return _select(scores, k)


def indexer_topk_cpu(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                     n_visible: torch.Tensor, k: int, scale: float) -> torch.Tensor | None:
    """The C kernel in csrc/indexer_cpu.c (scores and a heap top-k per row); None when it does not apply."""
    _check(q, weights, keys, start, n_visible)
    if not on_cpu(q, keys) or weights.dtype != torch.float32 or weights.device.type != "cpu":
        return None
    fn = library("indexer_cpu.c").function("indexer_topk", q.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    q, weights, keys = q.contiguous(), weights.contiguous(), keys.contiguous()
    start, n_visible = start.long().contiguous(), n_visible.long().contiguous()
    r, h, d = q.shape
    out = torch.empty(r, k, dtype=torch.long)
    if r and fn(q.data_ptr(), weights.data_ptr(), keys.data_ptr(), start.data_ptr(), n_visible.data_ptr(),
                out.data_ptr(), r, h, d, k, scale) != 0:
        return None
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                 n_visible: torch.Tensor, k: int, scale: float) -> torch.Tensor:
    if use_triton(q):
        return indexer_topk_triton(q, weights, keys, start, n_visible, k, scale)
    out = indexer_topk_cpu(q, weights, keys, start, n_visible, k, scale)
    return out if out is not None else indexer_topk_ref(q, weights, keys, start, n_visible, k, scale)
