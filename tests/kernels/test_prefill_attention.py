"""Varlen causal prefill attention over a paged cache: the C kernel (native build and the AVX2 /
scalar builds) and the per-sequence SDPA reference against a float64 loop."""
import ctypes

import pytest
import torch

from moebus.kernels import cpu_build
from moebus.kernels.prefill_attention import (
    _CPU_ARGTYPES,
    cpu_kernel_available,
    prefill_attention,
    prefill_attention_cpu,
    prefill_attention_ref,
)

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
# (new tokens, context after this step): fresh prompts of ragged lengths, chunks over cached context
SHAPES = [(37, 37), (1, 1), (128, 128), (5, 70), (64, 97), (33, 33)]


def make_inputs(dtype, shapes, hkv=3, group=3, d=64, dv=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for _, L in shapes) + 2
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(n_blocks, bs, hkv, dv, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g).tolist()  # scattered pages
    width = max(-(-L // bs) for _, L in shapes)
    tables, q_start, first = [], [], 0
    t = 3  # rows before the first sequence belong to nobody (e.g. a step's decode rows)
    for lq, L in shapes:
        nb = -(-L // bs)
        tables.append(perm[first:first + nb] + [0] * (width - nb))
        q_start.append(t)
        t += lq
        first += nb
    q = torch.randn(t + 2, hkv * group, d, generator=g).to(dtype)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), q_start,
            [lq for lq, _ in shapes], [L for _, L in shapes])


def naive(q, k_cache, v_cache, tables, q_start, q_len, seq_lens, scale, window=None, sinks=None):
    """float64 loop; rows of no sequence are zeros."""
    hq, hkv, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape[0], hq, v_cache.shape[3], dtype=torch.float64)
    for i, (s, n, L) in enumerate(zip(q_start, q_len, seq_lens, strict=True)):
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(L)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, dim=1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:s + n].double(), k) * scale
        qpos, kpos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = scores.softmax(-1)[..., :L]
        out[s:s + n] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _filled(out, q_start, q_len):
    return torch.cat([out[s:s + n] for s, n in zip(q_start, q_len, strict=True)])


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (20, False), (45, True)])
def test_cpu_kernel_matches_float64(dtype, window, with_sinks, close):
    if not cpu_kernel_available(dtype):
        pytest.skip("no C compiler")
    q, kc, vc, bt, qs, ql, sl = make_inputs(dtype, SHAPES)
    sinks = torch.randn(q.shape[1]) if with_sinks else None
    out = prefill_attention_cpu(q, kc, vc, bt, qs, ql, sl, 0.125, window, sinks)
    expected = naive(q, kc, vc, bt, qs, ql, sl, 0.125, window, sinks)
    close(_filled(out, qs, ql), _filled(expected, qs, ql), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (20, True)])
def test_reference_matches_float64(dtype, window, with_sinks, close):
    q, kc, vc, bt, qs, ql, sl = make_inputs(dtype, SHAPES)
    sinks = torch.randn(q.shape[1]) if with_sinks else None
    out = prefill_attention_ref(q, kc, vc, bt, qs, ql, sl, 0.125, window, sinks)
    expected = naive(q, kc, vc, bt, qs, ql, sl, 0.125, window, sinks)
    close(_filled(out, qs, ql), _filled(expected, qs, ql), *TOL[dtype])


@pytest.mark.parametrize("hkv,group,d,dv", [(1, 1, 16, 16), (2, 5, 48, 40), (1, 40, 128, 128), (2, 2, 8, 200)])
def test_cpu_kernel_odd_shapes(hkv, group, d, dv, close):
    """Head dims off the vector width, more heads per group than a task's row target."""
    if not cpu_kernel_available(torch.float32):
        pytest.skip("no C compiler")
    shapes = [(19, 19), (3, 50), (1, 1)]
    q, kc, vc, bt, qs, ql, sl = make_inputs(torch.float32, shapes, hkv, group, d, dv, bs=5)
    out = torch.full((q.shape[0], q.shape[1], dv), 7.0)
    prefill_attention_cpu(q, kc, vc, bt, qs, ql, sl, d**-0.5, None, None, out)
    close(_filled(out, qs, ql), _filled(naive(q, kc, vc, bt, qs, ql, sl, d**-0.5), qs, ql), *TOL[torch.float32])
    assert (out[:qs[0]] == 7.0).all() and (out[-2:] == 7.0).all()  # rows of no sequence untouched


def test_rows_do_not_depend_on_the_batch():
    """A sequence's rows are bitwise the same alone and among others (deterministic serving)."""
    if not cpu_kernel_available(torch.bfloat16):
        pytest.skip("no C compiler")
    q, kc, vc, bt, qs, ql, sl = make_inputs(torch.bfloat16, SHAPES)
    both = prefill_attention_cpu(q, kc, vc, bt, qs, ql, sl, 0.125)
    alone = prefill_attention_cpu(q, kc, vc, bt[4:5], qs[4:5], ql[4:5], sl[4:5], 0.125)
    assert torch.equal(both[qs[4]:qs[4] + ql[4]], alone[qs[4]:qs[4] + ql[4]])


def test_dispatcher_falls_back_to_reference_for_mixed_dtypes(close):
    q, kc, vc, bt, qs, ql, sl = make_inputs(torch.float32, SHAPES[:2])
    out = prefill_attention(q, kc.bfloat16(), vc.bfloat16(), bt, qs, ql, sl, 0.125)
    expected = naive(q, kc.bfloat16(), vc.bfloat16(), bt, qs, ql, sl, 0.125)
    close(_filled(out, qs, ql), _filled(expected, qs, ql), *TOL[torch.float32])


# The library builds with -march=native (AVX-512 here); these rebuild the source without the
# instructions an AVX2-only or a pre-AVX2 CPU lacks, so that those code paths are checked too.
FALLBACK_BUILDS = {"avx512-no-amx": ["-mno-amx-tile"], "avx2": cpu_build.NO_AVX512,
                   "scalar": cpu_build.SCALAR}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_lib(request, rebuilt):
    return rebuilt("prefill_attention_cpu.c", FALLBACK_BUILDS[request.param], request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_cpu_fallback_builds_match_float64(fallback_lib, dtype, close):
    fn = getattr(fallback_lib, f"prefill_attention_{cpu_build.DTYPE_SUFFIX[dtype]}")
    fn.argtypes, fn.restype = _CPU_ARGTYPES, ctypes.c_int
    q, kc, vc, bt, qs, ql, sl = make_inputs(dtype, SHAPES)
    sinks = torch.randn(q.shape[1])
    for window, sk in ((None, None), (20, sinks)):
        out = prefill_attention_cpu(q, kc, vc, bt, qs, ql, sl, 0.125, window, sk, fn=fn)
        expected = naive(q, kc, vc, bt, qs, ql, sl, 0.125, window, sk)
        close(_filled(out, qs, ql), _filled(expected, qs, ql), *TOL[dtype])
