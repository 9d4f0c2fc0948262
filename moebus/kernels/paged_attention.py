"""Decode attention over a paged KV cache: one query token per sequence, GQA, sliding window, sinks.

q [B, Hq, D] sits at position seq_lens[b]-1 of sequence b, whose K/V (current token included) is
in k_cache [N, bs, Hkv, D] / v_cache [N, bs, Hkv, Dv], logical block i in physical block
block_tables[b, i]. Query head h reads kv head h // (Hq // Hkv). A sliding window W keeps positions
p >= seq_len - W. Sinks [Hq] are extra per-head logits that only join the softmax denominator.
Softmax in float32; a sequence with nothing to attend (seq_len 0, no sink) gets zeros.
"""
from __future__ import annotations

import ctypes

import torch

from ._compat import check_launchable, next_pow2, tl, triton, upcast_dots, use_triton
from .cpu_build import I32, I64, PTR, library, on_cpu

_REF_CHUNK_ELEMS = 1 << 26  # bound on gathered K+V elements per batch chunk in the reference


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, sinks: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    b, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    assert v_cache.shape[:3] == (nb, bs, hkv), (k_cache.shape, v_cache.shape)
    assert dk == d and hq % hkv == 0, (q.shape, k_cache.shape)
    assert block_tables.dim() == 2 and block_tables.shape[0] == b and seq_lens.shape == (b,)
    if sinks is not None:
        assert sinks.shape == (hq,), sinks.shape
    return b, hq, hkv, d, v_cache.shape[3], bs


def _gather(cache: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
    """cache[phys] as float32 [n, n_blk * bs, Hkv, Dx] (the upcast, when needed, shares the copy)."""
    n, n_blk = phys.shape
    _, bs, hkv, dx = cache.shape
    if cache.dtype == torch.float32:
        return cache[phys].view(n, n_blk * bs, hkv, dx)
    out = torch.empty(n, n_blk, bs, hkv, dx, dtype=torch.float32, device=cache.device)
    out.copy_(cache[phys])
    return out.view(n, n_blk * bs, hkv, dx)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    b, hq, hkv, d, dv, bs = _check(q, k_cache, v_cache, block_tables, seq_lens, sinks)
    out = q.new_empty(b, hq, dv)
    if b == 0:
        return out
    lens = seq_lens.to(torch.long)
    first = (lens - sliding_window).clamp_min(0) if sliding_window is not None else torch.zeros_like(lens)
    first_blk = first // bs
    # Gather only the blocks that some query can see: n_blk per sequence, starting at first_blk.
    n_blk = int(((lens + bs - 1) // bs - first_blk).max().clamp_min(1))
    logical = first_blk[:, None] + torch.arange(n_blk, device=q.device)  # [B, n_blk]
    phys = block_tables.to(torch.long).gather(1, logical.clamp_max(block_tables.shape[1] - 1))
    pos = (logical[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(b, n_blk * bs)
    valid = (pos < lens[:, None]) & (pos >= first[:, None])  # [B, L]
    g = hq // hkv
    sink = sinks.float().view(1, hkv, g, 1) if sinks is not None else None
    chunk = max(1, _REF_CHUNK_ELEMS // (n_blk * bs * hkv * (d + dv)))
    for s in range(0, b, chunk):  # batch chunks bound memory; everything inside is batched
        e = min(s + chunk, b)
        # One gather copy per cache; each kv head is then a strided [n, L, D] view that BLAS reads
        # in place (a heads-major permute would cost a second full copy).
        k = _gather(k_cache, phys[s:e])
        v = _gather(v_cache, phys[s:e])
        qg = q[s:e].float().reshape(e - s, hkv, g, d)  # q may be a strided view
        hidden = ~valid[s:e, None, :]
        for h in range(hkv):
            scores = torch.matmul(qg[:, h], k[:, :, h].transpose(1, 2)) * scale  # [n, G, L]
            scores.masked_fill_(hidden, float("-inf"))
            m = scores.amax(dim=-1, keepdim=True)
            if sink is not None:
                m = torch.maximum(m, sink[:, h])
            m = m.masked_fill(torch.isinf(m), 0.0)  # nothing visible: avoid inf - inf
            p = torch.exp(scores - m)
            denom = p.sum(dim=-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink[:, h] - m)
            o = torch.matmul(p, v[:, :, h]) / denom.masked_fill(denom == 0, 1.0)
            out[s:e, h * g:(h + 1) * g] = o.to(q.dtype)
    return out


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, sinks_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, scale, window,
    group, head_dim, v_dim, block_size,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_btb, stride_ob, stride_oh,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # Program (b, kv head, split): the G query heads sharing a kv head form the M dim of tl.dot
    # (padded to 16), so K/V is read once per group. A tile is BLOCK_N consecutive positions,
    # which may span pages. Split s takes the s-th share of the visible tiles (flash decoding):
    # with NUM_SPLITS > 1 it writes unnormalized partials that _combine_splits merges.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < group
    heads = kvh * group + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & (d < head_dim)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_SINKS:
        # Starting the running max at the sink with mass exp(0)=1 puts it in the denominator.
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        l_i = tl.full((BLOCK_G,), 1.0, dtype=tl.float32)
    else:
        m_i = tl.full((BLOCK_G,), -1e30, dtype=tl.float32)  # finite: no inf - inf
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), dtype=tl.float32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    n_tiles = tl.cdiv(seq_len - start, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    for tile in range(split * per_split, tl.minimum((split + 1) * per_split, n_tiles)):
        pos = start + tile * BLOCK_N + n
        valid = pos < seq_len
        phys = tl.load(bt_ptr + b * stride_btb + pos // block_size, mask=valid, other=0).to(tl.int64)
        slot = (pos % block_size)[:, None]
        k = tl.load(k_ptr + phys[:, None] * stride_kn + slot * stride_ks + kvh * stride_kh + d[None, :],
                    mask=valid[:, None] & (d < head_dim)[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + phys[:, None] * stride_vn + slot * stride_vs + kvh * stride_vh + dv[None, :],
                    mask=valid[:, None] & (dv < v_dim)[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o_mask = g_mask[:, None] & (dv < v_dim)[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:  # partials are contiguous [B, Hq, NUM_SPLITS, (Dv)]
        row = (b * group * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(acc_ptr + row[:, None] * v_dim + dv[None, :], acc, mask=o_mask)
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)


def _combine_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,  # noqa: E741
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """Merge per-split softmax partials acc [B, Hq, S, Dv], m / l [B, Hq, S]; sinks join here."""
    m_max = m.amax(dim=-1)
    if sinks is not None:
        m_max = torch.maximum(m_max, sinks.float()[None])
    w = torch.exp(m - m_max[..., None])
    denom = (l * w).sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sinks.float()[None] - m_max)
    return (acc * w[..., None]).sum(dim=2) / denom.masked_fill(denom == 0, 1.0)[..., None]


def _auto_splits(q: torch.Tensor, programs: int, max_tiles: int) -> int:
    """Enough splits to fill the GPU (~2 programs per SM) while keeping >= 4 tiles per split."""
    if not q.is_cuda:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_tiles, 4)))


def paged_attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                                  *, block_n: int = 64, num_splits: int | None = None) -> torch.Tensor:
    b, hq, hkv, d, dv, bs = _check(q, k_cache, v_cache, block_tables, seq_lens, sinks)
    check_launchable(q, k_cache, v_cache, block_tables, seq_lens)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert k_cache.dtype == v_cache.dtype and block_n >= 16 and block_n == next_pow2(block_n)
    if sinks is not None:
        assert sinks.is_contiguous() and sinks.device == q.device
    out = torch.empty(b, hq, dv, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    g = hq // hkv
    # Host-side bound on visible positions (no sync on seq_lens): the table's capacity, or W.
    capacity = block_tables.shape[1] * bs
    max_ctx = capacity if sliding_window is None else min(capacity, sliding_window)
    splits = num_splits or _auto_splits(q, b * hkv, triton.cdiv(max_ctx, block_n))
    acc = m = l = out  # noqa: E741  (placeholders, unused when splits == 1)
    if splits > 1:
        acc = torch.empty(b, hq, splits, dv, dtype=torch.float32, device=q.device)
        m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)  # noqa: E741
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, sinks if sinks is not None else q, out, acc, m, l,
        float(scale), int(sliding_window or 0), g, d, dv, bs,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_G=max(16, next_pow2(g)), BLOCK_D=max(16, next_pow2(d)), BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_N=block_n, NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None and splits == 1, UPCAST=upcast_dots(q.dtype, k_cache.dtype),
        # fp32 models get exact fp32 dots, like torch's default (no TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    if splits > 1:
        out.copy_(_combine_splits(acc, m, l, sinks))
    return out


_CPU_SOURCE = "paged_attention_cpu.c"
_CPU_ARGTYPES = [PTR, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, I64, PTR, I64, PTR, PTR,
                 PTR, I64, I64, I32, I32, I32, I32, I32, I32, I32, ctypes.c_float]


def cpu_kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    return library(_CPU_SOURCE).function("paged_decode", dtype, _CPU_ARGTYPES) is not None


def paged_attention_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """The C kernel in csrc/paged_attention_cpu.c; None when it does not apply (use the reference)."""
    b, hq, hkv, d, dv, bs = _check(q, k_cache, v_cache, block_tables, seq_lens, sinks)
    fn = library(_CPU_SOURCE).function("paged_decode", q.dtype, _CPU_ARGTYPES) if on_cpu(q, k_cache, v_cache) else None
    if fn is None:
        return None
    bt = block_tables.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    sk = sinks.float().contiguous() if sinks is not None else None
    out = torch.empty(b, hq, dv, dtype=q.dtype)
    if b == 0:
        return out
    status = fn(q.data_ptr(), q.stride(0), q.stride(1),
                k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
                bt.data_ptr(), bt.stride(0), sl.data_ptr(), sk.data_ptr() if sk is not None else None,
                out.data_ptr(), out.stride(0), out.stride(1),
                b, hq, hkv, d, dv, bs, int(sliding_window or 0), float(scale))
    return out if status == 0 else None


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(q):
        return paged_attention_decode_triton(
            q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), scale, sliding_window,
            sinks.float().contiguous() if sinks is not None else None)
    out = paged_attention_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, sinks)
    if out is not None:
        return out
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      sliding_window, sinks)
