"""mHC mixing weights (kernels/mhc.py): reference vs a float64 loop, Triton and C vs the reference."""
import math

import pytest
import torch

from moebus.kernels import hc_merge, hc_merge_ref, hc_merge_triton, hc_mix, hc_mix_ref, hc_mix_triton
from moebus.kernels.mhc import hc_merge_cpu, hc_mix_cpu, hc_pre, hc_pre_cpu, hc_pre_ref
from moebus.kernels.paged_attention import cpu_kernel_available

CASES = [(1, 4, 20), (17, 4, 20), (64, 4, 1), (5, 3, 7), (9, 1, 3)]  # (T, n, iters)
EPS = 1e-6
TOL = (2e-5, 2e-5)


def _inputs(t: int, n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = (2 + n) * n
    mix = torch.randn(t, width + 3, device=device)[:, :width] * 3  # strided rows, as a split would give
    return mix, torch.randn(width, device=device), torch.rand(3, device=device) * 2 + 0.1


def naive(mix, base, scale, n, iters, eps):
    """One token at a time in float64, written from the definition."""
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pre, post, comb = [], [], []
    for row in mix.double().tolist():
        b = base.double().tolist()
        s = scale.double().tolist()
        pre.append([sig(row[i] * s[0] + b[i]) + eps for i in range(n)])
        post.append([2 * sig(row[n + i] * s[1] + b[n + i]) for i in range(n)])
        c = [[row[2 * n + r * n + j] * s[2] + b[2 * n + r * n + j] for j in range(n)] for r in range(n)]
        c = [[math.exp(v - max(r)) / sum(math.exp(w - max(r)) for w in r) + eps for v in r] for r in c]

        def cols(c):
            sums = [sum(c[r][j] for r in range(n)) for j in range(n)]
            return [[c[r][j] / (sums[j] + eps) for j in range(n)] for r in range(n)]

        c = cols(c)
        for _ in range(iters - 1):
            c = cols([[v / (sum(r) + eps) for v in r] for r in c])
        comb.append(c)
    return torch.tensor(pre), torch.tensor(post), torch.tensor(comb)


def _check_all(got, expected, close):
    for a, e in zip(got, expected, strict=True):
        assert a.shape == e.shape and a.dtype == torch.float32
        close(a, e, *TOL)


@pytest.mark.parametrize("t,n,iters", CASES)
def test_ref_matches_fp64(t, n, iters, close):
    mix, base, scale = _inputs(t, n)
    _check_all(hc_mix_ref(mix, base, scale, n, iters, EPS), naive(mix, base, scale, n, iters, EPS), close)


def test_sinkhorn_converges_to_doubly_stochastic():
    mix, base, scale = _inputs(8, 4)
    _, _, comb = hc_mix_ref(mix, base, scale, 4, 50, EPS)
    torch.testing.assert_close(comb.sum(-2), torch.ones(8, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(8, 4), atol=1e-3, rtol=0)


@pytest.mark.parametrize("t,n,iters", CASES)
def test_triton_matches_ref(t, n, iters, triton_device, close):
    mix, base, scale = _inputs(t, n, triton_device)
    _check_all(hc_mix_triton(mix, base, scale, n, iters, EPS), hc_mix_ref(mix, base, scale, n, iters, EPS), close)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("t,n,iters", [*CASES, (600, 4, 20)])  # 600: the OpenMP-parallel path
def test_cpu_matches_ref(t, n, iters, close):
    mix, base, scale = _inputs(t, n)
    got = hc_mix_cpu(mix, base, scale, n, iters, EPS)
    assert got is not None
    _check_all(got, hc_mix_ref(mix, base, scale, n, iters, EPS), close)
    assert all(torch.equal(a, b) for a, b in zip(hc_mix(mix, base, scale, n, iters, EPS), got, strict=True))


def test_cpu_declines_and_dispatcher_falls_back(close):
    mix, base, scale = _inputs(3, 17)  # n above the C kernel's limit
    assert hc_mix_cpu(mix, base, scale, 17, 2, EPS) is None
    _check_all(hc_mix(mix, base, scale, 17, 2, EPS), hc_mix_ref(mix, base, scale, 17, 2, EPS), close)
    assert hc_mix_cpu(mix.double(), base.double(), scale.double(), 17, 2, EPS) is None


MERGE_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
MERGE_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}  # the ref rounds comb and each op to bf16
MERGE_CASES = [(1, 4, 128), (17, 4, 81), (5, 3, 300), (600, 4, 64)]  # (T, n, H); 300 > the C kernel's 256 chunk


def _merge_inputs(t, n, h, dtype, device="cpu"):
    streams = torch.randn(t, n, h, device=device).to(dtype)
    block_out = torch.randn(t, h, device=device).to(dtype)
    post = torch.rand(t, n, device=device) * 2
    mix, base, scale = _inputs(t, n, device)
    _, _, comb = hc_mix_ref(mix, base, scale, n, 20, EPS)
    return streams, block_out, post, comb


def naive_merge(streams, block_out, post, comb):
    s, b, p, c = (x.double() for x in (streams, block_out, post, comb))
    t, n, h = s.shape
    out = torch.zeros(t, n, h, dtype=torch.float64)
    for k in range(n):
        out[:, k] = p[:, k, None] * b
        for j in range(n):
            out[:, k] += c[:, j, k, None] * s[:, j]
    return out


@MERGE_DTYPES
@pytest.mark.parametrize("t,n,h", MERGE_CASES)
def test_merge_ref_matches_fp64(t, n, h, dtype, close):
    args = _merge_inputs(t, n, h, dtype)
    out = hc_merge_ref(*args)
    assert out.shape == (t, n, h) and out.dtype == dtype
    close(out, naive_merge(*args), *MERGE_TOL[dtype])


@MERGE_DTYPES
@pytest.mark.parametrize("t,n,h", MERGE_CASES[:3])
def test_merge_triton_matches_ref(t, n, h, dtype, triton_device, close):
    args = _merge_inputs(t, n, h, dtype, triton_device)
    close(hc_merge_triton(*args), hc_merge_ref(*args), *MERGE_TOL[dtype])


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
@MERGE_DTYPES
@pytest.mark.parametrize("t,n,h", MERGE_CASES)
def test_merge_cpu_matches_ref(t, n, h, dtype, close):
    args = _merge_inputs(t, n, h, dtype)
    out = hc_merge_cpu(*args)
    assert out is not None and out.dtype == dtype
    close(out, naive_merge(*args), *MERGE_TOL[dtype])
    close(out, hc_merge_ref(*args), *MERGE_TOL[dtype])
    assert torch.equal(hc_merge(*args), out)
    streams, block_out, post, comb = args
    if t > 1:  # token-major layout is required
        assert hc_merge_cpu(streams.transpose(0, 1).contiguous().transpose(0, 1), block_out, post, comb) is None


PRE_CASES = [(1, 4, 128), (17, 4, 81), (5, 3, 300), (600, 4, 64), (6, 1, 40)]  # (T, n, H); odd T: a lone last token


def _pre_inputs(t, n, h, dtype):
    streams = torch.randn(t, n, h).to(dtype)
    width = (2 + n) * n
    fn = torch.randn(width, n * h) / math.sqrt(n * h)
    _, base, scale = _inputs(1, n)
    return streams, fn, base, scale


def naive_pre(streams, fn, base, scale, n, iters, hc_eps, norm_eps):
    """float64 from the definition: RMS-normalised flattened streams, mixture, gates, collapse."""
    x = streams.double().flatten(1)
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm_eps)
    mix = x @ fn.double().t()
    pre, post, comb = naive(mix, base, scale, n, iters, hc_eps)
    collapsed = (pre.double().unsqueeze(-1) * streams.double()).sum(1)
    return collapsed, post, comb


@MERGE_DTYPES
@pytest.mark.parametrize("t,n,h", PRE_CASES)
def test_pre_ref_and_cpu_match_fp64(t, n, h, dtype, close):
    args = (*_pre_inputs(t, n, h, dtype), n, 20, EPS, 1e-6)
    expected = naive_pre(*args)
    outs = [hc_pre_ref(*args)]
    if cpu_kernel_available():
        got = hc_pre_cpu(*args)
        assert got is not None and got[0].dtype == dtype
        outs.append(got)
        assert all(torch.equal(a, b) for a, b in zip(hc_pre(*args), got, strict=True))
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 2e-2)}[dtype]  # bf16: the collapse rounds once
    for out in outs:
        for a, e in zip(out, expected, strict=True):
            close(a.double(), e, *(tol if a.dtype == torch.bfloat16 else (1e-4, 1e-4)))


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
def test_pre_cpu_is_batch_invariant():
    streams, fn, base, scale = _pre_inputs(9, 4, 64, torch.float32)
    together = hc_pre_cpu(streams, fn, base, scale, 4, 20, EPS, 1e-6)
    for i in range(9):
        alone = hc_pre_cpu(streams[i:i + 1], fn, base, scale, 4, 20, EPS, 1e-6)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, together, strict=True))
