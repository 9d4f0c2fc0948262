"""attend() on mixed steps (decode rows + prefill chunks with and without cached context) against
dense attention computed per sequence from the cache it wrote."""
import pytest
import torch

import moebus.engine.attention as attention
from moebus.engine.attention import AttentionMetadata, attend

BS, HKV, G, D = 4, 2, 3, 16


@pytest.fixture(params=["kernel", "torch"])
def prefill_path(request, monkeypatch):
    """On CPU the prefill chunks take the C kernel; "torch" makes it decline, so that the banded and
    per-sequence SDPA paths (the GPU's, and the fallback without a compiler) are checked here too."""
    if request.param == "torch":
        monkeypatch.setattr("moebus.platforms.cpu.platform.prefill_attention_cpu", lambda *a, **k: None)
    return request.param


def _naive(q, k, v, scale, window):
    """q [lq, Hq, D] are the last lq positions of context k/v [L, Hkv, D]; float64."""
    lq, L = q.shape[0], k.shape[0]
    k, v = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(L - lq, L)[:, None]
    kpos = torch.arange(L)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _paged_step(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float32):
    """A step over scattered pages: shapes are (new tokens, context after this step) per sequence.
    Returns (q, k, v, caches, meta, per-sequence context slots)."""
    n_blocks = sum(-(-L // BS) for _, L in shapes) + 3
    k_cache = torch.randn(n_blocks, BS, HKV, D, dtype=dtype)
    v_cache = torch.randn(n_blocks, BS, HKV, D, dtype=dtype)
    perm = torch.randperm(n_blocks).tolist()  # scattered pages
    width = max(-(-L // BS) for _, L in shapes)
    tables, slots, qsl, first = [], [], [0], 0
    for lq, L in shapes:
        nb = -(-L // BS)
        tables.append(perm[first:first + nb] + [0] * (width - nb))
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(L - lq, L)]
        qsl.append(qsl[-1] + lq)
        first += nb
    T = qsl[-1]
    q = torch.randn(T, HKV * G, D, dtype=dtype)
    k, v = torch.randn(T, HKV, D, dtype=dtype), torch.randn(T, HKV, D, dtype=dtype)
    seq_lens = [L for _, L in shapes]
    meta = AttentionMetadata(qsl, seq_lens, torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), BS)
    ctx = [[tables[b][p // BS] * BS + p % BS for p in range(L)] for b, (_, L) in enumerate(shapes)]
    return q, k, v, (k_cache, v_cache), meta, ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_step_matches_dense_attention_per_sequence(dtype, window, prefill_path):
    torch.manual_seed(0)
    # (new tokens, context after this step): decode rows, a chunk over cached context, a fresh prompt
    shapes = [(1, 20), (5, 30), (1, 37), (9, 9), (1, 1)]
    q, k, v, (k_cache, v_cache), meta, ctx = _paged_step(shapes, dtype)
    qsl = meta.query_start_loc
    assert not meta.decode_only
    out = attend(q, k, v, (k_cache, v_cache), meta, D**-0.5, sliding_window=window)
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    slots = meta.slot_mapping
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)  # this step's KV written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(shapes)):
        ref = _naive(q[qsl[b]:qsl[b + 1]], flat_k[ctx[b]], flat_v[ctx[b]], D**-0.5, window)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]].double(), ref, rtol=tol, atol=tol)


def _naive_sinks(q, k, v, scale, window, sinks):
    """float64 loop: q [Lq, Hq, D] are the last Lq of L positions; a sink adds exp(sinks[h]) to the
    softmax denominator and nothing to the numerator."""
    lq, hq, _ = q.shape
    L, hkv, _ = k.shape
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    for i in range(lq):
        p = L - lq + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(hq):
            kh = h // (hq // hkv)
            s = (k[lo:p + 1, kh].double() @ q[i, h].double()) * scale
            w = torch.exp(s - s.max())
            den = w.sum() + torch.exp(sinks[h].double() - s.max())
            out[i, h] = (w[:, None] * v[lo:p + 1, kh].double()).sum(0) / den
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lq", [1, 7, 19])  # decode row, a chunk after cached context, a whole prompt
def test_prefill_with_sinks_matches_fp64(window, lq):
    from moebus.kernels.prefill_attention import attend_one_ref

    torch.manual_seed(0)
    L, hq, hkv, d = 19, 6, 2, 16
    q, k, v = torch.randn(lq, hq, d), torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    sinks = torch.randn(hq) * 2
    out = attend_one_ref(q, k, v, d ** -0.5, window, sinks)
    torch.testing.assert_close(out.double(), _naive_sinks(q, k, v, d ** -0.5, window, sinks), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 64])  # 64 elements: one query row per gathered chunk
def test_banded_sliding_window_prefill_with_sinks_matches_fp64(chunk, monkeypatch, prefill_path):
    """Sliding-window chunks (fresh prompts, chunks over cached context, a lone decode row) all go
    through the banded path (or the C kernel) at once; each sequence against the float64 loop with sinks."""
    if chunk is not None:
        monkeypatch.setattr(attention, "_BANDED_CHUNK", chunk)
    torch.manual_seed(1)
    window = 5
    shapes = [(7, 7), (4, 23), (1, 12), (11, 30)]  # (new tokens, context after this step)
    q, k, v, (k_cache, v_cache), meta, ctx = _paged_step(shapes)
    qsl = meta.query_start_loc
    sinks = torch.randn(HKV * G) * 2
    out = attend(q, k, v, (k_cache, v_cache), meta, D**-0.5, sliding_window=window, sinks=sinks)
    flat_k, flat_v = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
    for b in range(len(shapes)):
        ref = _naive_sinks(q[qsl[b]:qsl[b + 1]], flat_k[ctx[b]], flat_v[ctx[b]], D**-0.5, window, sinks)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]].double(), ref, rtol=1e-5, atol=1e-5)
