"""Causal prefill attention over a paged KV cache, every prefill chunk of a step in one call.

q [T, Hq, Dk] holds the step's query rows; sequence i owns rows q_start[i] .. q_start[i] + q_len[i],
the last q_len[i] positions of a context of seq_lens[i] tokens whose K/V (this step's included)
are in k_cache [N, bs, Hkv, Dk] / v_cache [N, bs, Hkv, Dv], logical block j in physical block
block_tables[i, j]. Query head h reads kv head h // (Hq // Hkv). A sliding window W lets position
p see keys (p - W, p]; sinks [Hq] are extra per-head logits with a zero value. Returns out
[T, Hq, Dv] with the rows of the listed sequences filled (the others are left as they were, when
`out` is passed). Softmax in float32.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .cpu_build import I32, I64, PTR, library, on_cpu


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           q_start: list[int], q_len: list[int], seq_lens: list[int], sinks: torch.Tensor | None) -> None:
    _, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    assert v_cache.shape[:3] == (nb, bs, hkv), (k_cache.shape, v_cache.shape)
    assert dk == d and hq % hkv == 0, (q.shape, k_cache.shape)
    assert len(q_start) == len(q_len) == len(seq_lens) == block_tables.shape[0], (q_start, q_len, seq_lens)
    assert all(0 < n <= L for n, L in zip(q_len, seq_lens, strict=True)), (q_len, seq_lens)
    if sinks is not None:
        assert sinks.shape == (hq,), sinks.shape


def gather_seq(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's first seq_len rows of a paged cache [N, bs, ...] as one [seq_len, ...] tensor."""
    bs = cache.shape[1]
    return cache[table[:(seq_len + bs - 1) // bs].long()].flatten(0, 1)[:seq_len]


def attend_one_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of a context whose keys are k [L, Hkv, D]."""
    lq, hq, _ = q.shape
    L, hkv, _ = k.shape
    gqa = hq != hkv
    # 4-D [1, H, L, D] with enable_gqa: torch's CPU flash kernel takes these (3-D inputs and
    # repeated kv heads fall back to the unfused math path, far slower).
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask = None
    if window is not None or lq != L or sinks is not None:
        qpos = torch.arange(L - lq, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    # A sink is one more key whose logit is sinks[h] for every query and whose value is zero: a
    # zero key (q.k = 0) plus an additive mask column holding the sink. One fused SDPA call, in
    # float32, instead of an einsum / softmax / einsum (faster with a window and without one).
    bias = torch.zeros(hq, lq, L + 1, dtype=torch.float32, device=q.device)
    bias[:, :, :L].masked_fill_(~mask, float("-inf"))
    bias[:, :, L] = sinks.float()[:, None]
    kz = torch.cat([kh.float(), kh.new_zeros(1, hkv, 1, kh.shape[-1], dtype=torch.float32)], dim=2)
    vz = torch.cat([vh.float(), vh.new_zeros(1, hkv, 1, vh.shape[-1], dtype=torch.float32)], dim=2)
    out = F.scaled_dot_product_attention(qh.float(), kz, vz, attn_mask=bias[None], scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, q_start: list[int], q_len: list[int], seq_lens: list[int],
                          scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """One SDPA call per sequence over its context gathered from the cache."""
    _check(q, k_cache, v_cache, block_tables, q_start, q_len, seq_lens, sinks)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    for i, (s, n, L) in enumerate(zip(q_start, q_len, seq_lens, strict=True)):
        k = gather_seq(k_cache, block_tables[i], L).to(q.dtype)
        v = gather_seq(v_cache, block_tables[i], L).to(q.dtype)
        out[s:s + n] = attend_one_ref(q[s:s + n], k, v, scale, sliding_window, sinks)
    return out


_CPU_SOURCE = "prefill_attention_cpu.c"
_CPU_ARGTYPES = [PTR, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, I64, PTR, I64, PTR, PTR, PTR,
                 PTR, PTR, I64, I64, I32, I32, I32, I32, I32, I32, I32, ctypes.c_float]


def cpu_kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    return library(_CPU_SOURCE).function("prefill_attention", dtype, _CPU_ARGTYPES) is not None


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, q_start: list[int], q_len: list[int], seq_lens: list[int],
                          scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                          out: torch.Tensor | None = None, *, fn=None) -> torch.Tensor | None:
    """The C kernel in csrc/prefill_attention_cpu.c (or `fn`, one of its builds); None when it does
    not apply (use the reference)."""
    _check(q, k_cache, v_cache, block_tables, q_start, q_len, seq_lens, sinks)
    if fn is None and on_cpu(q, k_cache, v_cache):
        fn = library(_CPU_SOURCE).function("prefill_attention", q.dtype, _CPU_ARGTYPES)
    if fn is None or not on_cpu(q, k_cache, v_cache):
        return None
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    assert out.dtype == q.dtype and out.stride(-1) == 1 and out.shape[0] == q.shape[0], out.shape
    bt = block_tables.to(torch.int32).contiguous()
    ints = torch.tensor([q_start, q_len, seq_lens], dtype=torch.int32)
    sk = sinks.float().contiguous() if sinks is not None else None
    status = fn(q.data_ptr(), q.stride(0), q.stride(1),
                k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
                bt.data_ptr(), bt.stride(0), ints[0].data_ptr(), ints[1].data_ptr(), ints[2].data_ptr(),
                sk.data_ptr() if sk is not None else None, out.data_ptr(), out.stride(0), out.stride(1),
                len(q_len), q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3], k_cache.shape[1],
                int(sliding_window or 0), float(scale))
    return out if status == 0 else None


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      q_start: list[int], q_len: list[int], seq_lens: list[int], scale: float,
                      sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    res = prefill_attention_cpu(q, k_cache, v_cache, block_tables, q_start, q_len, seq_lens, scale,
                                sliding_window, sinks, out)
    if res is not None:
        return res
    return prefill_attention_ref(q, k_cache, v_cache, block_tables, q_start, q_len, seq_lens, scale,
                                 sliding_window, sinks, out)
