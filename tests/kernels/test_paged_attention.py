import ctypes

import pytest
import torch

from moebus.kernels import (
    cpu_build,
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_decode_triton,
)
from moebus.kernels.paged_attention import _CPU_ARGTYPES, cpu_kernel_available, paged_attention_decode_cpu

needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")

# bf16: the Triton kernel feeds bf16 probabilities to the PV dot, as flash attention does.
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
SEQ_LENS = [1, 17, 33, 48]  # one token, mid-block, just past a block, exactly 3 full blocks
BS = 16
HKV = 2


def make_inputs(dtype, device, group, d, dv, seq_lens=SEQ_LENS, bs=BS):
    """A shuffled paged cache: sequence b's logical blocks scattered over physical blocks."""
    n_blocks = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(n_blocks) + 3
    max_blocks = max(n_blocks) + 1  # one column of padding at least
    perm = torch.randperm(num_blocks)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks))  # padding: any valid block
    off = 0
    for b, n in enumerate(n_blocks):
        block_tables[b, :n] = perm[off:off + n]
        off += n
    k_cache = torch.randn(num_blocks, bs, HKV, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, bs, HKV, dv, dtype=dtype, device=device)
    q = torch.randn(len(seq_lens), HKV * group, d, dtype=dtype, device=device) * 3  # peaky softmax
    sinks = torch.randn(HKV * group, device=device) * 2
    return (q, k_cache, v_cache, block_tables.to(torch.int32).to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), d ** -0.5, sinks)


def naive_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sinks):
    b_sz, hq, _ = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b_sz, hq, v_cache.shape[-1], dtype=torch.float64)
    for b in range(b_sz):
        n = int(seq_lens[b])
        visible = [p for p in range(n) if window is None or p > n - 1 - window]
        if not visible:
            continue
        for h in range(hq):
            kvh = h // (hq // hkv)
            slots = [(int(block_tables[b, p // bs]), p % bs) for p in visible]
            keys = torch.stack([k_cache[blk, s, kvh] for blk, s in slots]).double()
            vals = torch.stack([v_cache[blk, s, kvh] for blk, s in slots]).double()
            logits = keys @ q[b, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h:h + 1].double()])
            probs = torch.softmax(logits, 0)[: len(visible)]
            out[b, h] = probs @ vals
    return out


GRID = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CASES = [
    pytest.param(g, w, s, d, dv, id=f"G{g}-W{w}-{'sinks' if s else 'nosinks'}-D{d}-Dv{dv}")
    for g in (1, 4) for w in (None, 7, 20) for s in (False, True) for d, dv in ((64, 64), (81, 48))
]
# Triton tile / split-KV configs, cycled over CASES: 16-token tiles (several per sequence,
# online softmax across tiles and pages), 3 splits (some empty for short sequences), defaults.
CONFIGS = [(16, 1), (16, 3), (64, None)]
TRITON_CASES = [pytest.param(*c.values, *CONFIGS[i % len(CONFIGS)], id=f"{c.id}-N{CONFIGS[i % len(CONFIGS)][0]}"
                             f"-S{CONFIGS[i % len(CONFIGS)][1]}") for i, c in enumerate(CASES)]


@GRID
@pytest.mark.parametrize("group,window,use_sinks,d,dv", CASES)
def test_ref_matches_fp64(dtype, group, window, use_sinks, d, dv, close):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, "cpu", group, d, dv)
    sinks = sinks if use_sinks else None
    out = paged_attention_decode_ref(q, kc, vc, bt, sl, scale, window, sinks)
    assert out.shape == (q.shape[0], q.shape[1], dv) and out.dtype == dtype
    close(out, naive_decode(q, kc, vc, bt, sl, scale, window, sinks), *TOL[dtype])


@GRID
@pytest.mark.parametrize("group,window,use_sinks,d,dv,block_n,splits", TRITON_CASES)
def test_triton_matches_ref(dtype, group, window, use_sinks, d, dv, block_n, splits, triton_device, close):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, triton_device, group, d, dv)
    sinks = sinks if use_sinks else None
    out = paged_attention_decode_triton(q, kc, vc, bt, sl, scale, window, sinks, block_n=block_n,
                                        num_splits=splits)
    assert out.shape == (q.shape[0], q.shape[1], dv) and out.dtype == dtype
    close(out, paged_attention_decode_ref(q, kc, vc, bt, sl, scale, window, sinks), *TOL[dtype])


@pytest.mark.parametrize("bs,splits", [(8, 1), (32, 4)])
def test_triton_strided_q_other_page_sizes_long_context(bs, splits, triton_device, close):
    # q as a view of a fused qkv projection; pages smaller and larger than the 16-token tile;
    # a window wider than some sequences and narrower than others.
    q, kc, vc, bt, sl, scale, sinks = make_inputs(torch.float32, triton_device, 4, 64, 64,
                                                  seq_lens=[150, 3, 64], bs=bs)
    q_view = torch.cat([q, torch.randn_like(q)], dim=1)[:, : q.shape[1]]
    assert not q_view.is_contiguous()
    out = paged_attention_decode_triton(q_view, kc, vc, bt, sl, scale, 100, sinks, block_n=16,
                                        num_splits=splits)
    close(out, paged_attention_decode_ref(q_view, kc, vc, bt, sl, scale, 100, sinks), *TOL[torch.float32])
    close(out, naive_decode(q, kc, vc, bt, sl, scale, 100, sinks), *TOL[torch.float32])


def _check_empty_sequence_gives_zeros(fn, device, **kwargs):
    q, kc, vc, bt, _, scale, sinks = make_inputs(torch.float32, device, 1, 64, 64, seq_lens=[5, 1])
    sl = torch.tensor([0, 1], dtype=torch.int32, device=device)  # e.g. a padded batch slot
    for s in (None, sinks):
        out = fn(q, kc, vc, bt, sl, scale, None, s, **kwargs)
        assert torch.isfinite(out).all() and not out[0].any()


def test_ref_empty_sequence_gives_zeros():
    _check_empty_sequence_gives_zeros(paged_attention_decode_ref, "cpu")


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_empty_sequence_gives_zeros(splits, triton_device):
    _check_empty_sequence_gives_zeros(paged_attention_decode_triton, triton_device, num_splits=splits)


CPU_TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group,window,use_sinks,d,dv", CASES)
def test_cpu_kernel_matches_ref(dtype, group, window, use_sinks, d, dv, close):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, "cpu", group, d, dv)
    sinks = sinks if use_sinks else None
    out = paged_attention_decode_cpu(q, kc, vc, bt, sl, scale, window, sinks)
    assert out is not None and out.shape == (q.shape[0], q.shape[1], dv) and out.dtype == dtype
    # both accumulate in float32 from the same inputs: only summation order and rounding differ
    close(out, paged_attention_decode_ref(q, kc, vc, bt, sl, scale, window, sinks), *CPU_TOL[dtype])
    close(out, naive_decode(q, kc, vc, bt, sl, scale, window, sinks), *TOL.get(dtype, CPU_TOL[dtype]))


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])  # bf16: the vdpbf16ps path
@pytest.mark.parametrize("bs", [1, 8, 32])
def test_cpu_kernel_strided_q_page_sizes_long_context(bs, dtype, close):
    # contexts longer than the kernel's 32-position tile, pages smaller and larger than it
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, "cpu", 4, 64, 64, seq_lens=[150, 3, 64, 0], bs=bs)
    q_view = torch.cat([q, torch.randn_like(q)], dim=1)[:, : q.shape[1]]
    assert not q_view.is_contiguous()
    for window, s in ((None, None), (100, sinks), (33, None)):
        out = paged_attention_decode_cpu(q_view, kc, vc, bt, sl, scale, window, s)
        close(out, naive_decode(q, kc, vc, bt, sl, scale, window, s), *TOL[dtype])
        assert not out[3].any()  # the empty sequence


@needs_cpu_kernel
def test_cpu_kernel_empty_sequence_gives_zeros():
    _check_empty_sequence_gives_zeros(paged_attention_decode_cpu, "cpu")


def test_cpu_kernel_declines_what_it_does_not_cover():
    q, kc, vc, bt, sl, scale, _ = make_inputs(torch.float32, "cpu", 1, 64, 64)
    assert paged_attention_decode_cpu(q, kc.double(), vc.double(), bt, sl, scale) is None  # no fp64 build
    assert paged_attention_decode_cpu(q.bfloat16(), kc, vc, bt, sl, scale) is None  # mixed dtypes


def test_dispatch_cpu_uses_kernel_else_reference(monkeypatch):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(torch.bfloat16, "cpu", 4, 64, 64)
    out = paged_attention_decode(q, kc, vc, bt, sl, scale, sliding_window=20, sinks=sinks)
    if cpu_kernel_available(torch.bfloat16):
        assert torch.equal(out, paged_attention_decode_cpu(q, kc, vc, bt, sl, scale, 20, sinks))
    else:
        assert torch.equal(out, paged_attention_decode_ref(q, kc, vc, bt, sl, scale, 20, sinks))


@needs_cpu_kernel
@pytest.mark.parametrize("d", [128, 256])  # the kernel's unrolled D=128 path and its size limit
def test_cpu_kernel_wide_heads(d, close):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(torch.bfloat16, "cpu", 2, d, d)
    out = paged_attention_decode_cpu(q, kc, vc, bt, sl, scale, 20, sinks)
    close(out, naive_decode(q, kc, vc, bt, sl, scale, 20, sinks), *TOL[torch.bfloat16])


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6])  # register-held V accumulators for G <= 4, loop above
def test_cpu_kernel_every_group_size(group, d, dtype, close):
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, "cpu", group, d, d, seq_lens=[70, 1, 33])
    out = paged_attention_decode_cpu(q, kc, vc, bt, sl, scale, None, sinks)
    close(out, naive_decode(q, kc, vc, bt, sl, scale, None, sinks), *TOL.get(dtype, CPU_TOL[dtype]))


# The library builds with -march=native (AVX-512 and AVX512-BF16 here); these rebuild the source
# without the paths an AVX2-only or a pre-AVX2 CPU lacks, so that their tiles are checked here too.
FALLBACK_BUILDS = {"avx2": cpu_build.NO_AVX512, "scalar": cpu_build.SCALAR}


@pytest.fixture(scope="module", params=sorted(FALLBACK_BUILDS))
def fallback_lib(request, rebuilt):
    return rebuilt("paged_attention_cpu.c", FALLBACK_BUILDS[request.param], request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 3, 4, 5])  # register-held V accumulators for G <= 4, loop above
def test_cpu_fallback_builds_match_naive(fallback_lib, group, dtype, close):
    fn = getattr(fallback_lib, f"paged_decode_{cpu_build.DTYPE_SUFFIX[dtype]}")
    fn.argtypes, fn.restype = _CPU_ARGTYPES, ctypes.c_int
    q, kc, vc, bt, sl, scale, sinks = make_inputs(dtype, "cpu", group, 64, 64, seq_lens=[70, 1, 33, 0, 40])
    for window, s in ((None, None), (20, sinks)):
        out = torch.empty(q.shape, dtype=dtype)
        assert fn(q.data_ptr(), q.stride(0), q.stride(1), kc.data_ptr(), *kc.stride()[:3], vc.data_ptr(),
                  *vc.stride()[:3], bt.data_ptr(), bt.stride(0), sl.data_ptr(), s.data_ptr() if s is not None else None,
                  out.data_ptr(), out.stride(0), out.stride(1), *bt.shape[:1], q.shape[1], HKV, 64, 64, BS,
                  window or 0, scale) == 0
        close(out, naive_decode(q, kc, vc, bt, sl, scale, window, s), *TOL.get(dtype, CPU_TOL[dtype]))
