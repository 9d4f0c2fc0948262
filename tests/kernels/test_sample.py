"""Inverse-CDF sampling from logits (kernels/sample.py): the reference against a float64 loop, the C
kernel against the reference's CDF, and the drawn frequencies against softmax(x / T)."""
import math

import pytest
import torch

from moebus.kernels import sample_logits, sample_logits_ref
from moebus.kernels.paged_attention import cpu_kernel_available
from moebus.kernels.sample import (
    sample_logits_cpu,
    softmax_mass,
    softmax_mass_ref,
    top_p_floor,
    top_p_floor_ref,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
SHAPES = [(1, 1), (3, 17), (7, 257), (64, 4113), (600, 300)]  # 257: one past the C block; 600 rows: OpenMP
needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")


def _cases(shape, dtype, seed=0):
    """Strided rows of random logits, some masked to -inf, with temperatures (some 0: greedy),
    uniforms (0 and the largest double below 1 among them) and floors (-inf, a row's 3rd largest
    logit, its median, one above the max), plus the special rows: NaN, all -inf, +inf, a tie for
    the max on a greedy row."""
    b, n = shape
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(b, n + 5, generator=g))[:, :n].to(dtype)
    x[torch.rand(b, n, generator=g) < 0.3] = -math.inf
    temp = 0.2 + 2 * torch.rand(b, generator=g)
    temp[::5] = 0.0
    u = torch.rand(b, dtype=torch.float64, generator=g)
    u[1::7] = 0.0
    u[2::7] = 1.0 - 2.0**-53
    xs = x.float().sort(dim=1, descending=True).values
    floor = torch.full((b,), -math.inf)
    floor[1::3] = xs[1::3, min(2, n - 1)]
    floor[2::3] = xs[2::3, n // 2]
    floor[-1] = xs[-1, 0] + 1.0
    if n > 5 and b >= 7:
        x[3, 4] = x[3, n - 1] = math.nan
        x[4] = -math.inf
        x[6, 2] = math.inf
        x[5, 1] = x[5, n - 2] = 1e4  # row 5 is greedy: the first of the tie
    return x, temp, u, floor


def naive(x, temp, u, floor):
    out = []
    for row, t, ub, lo in zip(x.double().tolist(), temp.tolist(), u.tolist(), floor.tolist(), strict=True):
        nans = [i for i, v in enumerate(row) if v != v]
        m = max(row)
        if nans:
            out.append(nans[0])
        elif t <= 0 or math.isinf(m) or lo > m:
            out.append(row.index(m))
        else:
            p = [math.exp((v - m) / t) if v >= lo else 0.0 for v in row]
            target, cum = ub * sum(p), 0.0
            out.append(next((i for i, pi in enumerate(p) if (cum := cum + pi) > target), len(p) - 1))
    return torch.tensor(out)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_ref_matches_naive(shape, dtype):
    x, temp, u, floor = _cases(shape, dtype)
    assert torch.equal(sample_logits_ref(x, temp, u, floor), naive(x, temp, u, floor))
    assert torch.equal(sample_logits_ref(x, temp, u), naive(x, temp, u, torch.full_like(floor, -math.inf)))


def _assert_within_cdf_step(x, temp, u, floor, got):
    """got[b] is the token whose CDF step holds u_b * total, up to 1e-5 of the total (the C kernel's
    float32 exp and sums); the special rows match the reference exactly, and the others but a few.
    The reference's exp keeps masses below e^-87 that the kernel's flushes to 0, so the rows with u
    at the ends (0, 1 - 2^-53) may pick another token among those, and are left out of the count."""
    ref = sample_logits_ref(x, temp, u, floor)
    m = x.double().amax(1)
    sampled = (temp > 0) & m.isfinite() & (floor <= m)
    assert torch.equal(got[~sampled], ref[~sampled])
    xd = x.double()[sampled]
    p = ((xd - xd.amax(1, keepdim=True)) / temp[sampled].double().unsqueeze(1)).exp()
    p = p.masked_fill(xd < floor[sampled].double().unsqueeze(1), 0.0)
    cdf = p.cumsum(1)
    total = cdf[:, -1]
    target = u[sampled] * total
    tok = got[sampled].unsqueeze(1)
    hi = cdf.gather(1, tok).squeeze(1)
    lo = hi - p.gather(1, tok).squeeze(1)
    assert (p.gather(1, tok) > 0).all(), "drew a token without mass"
    slack = 1e-5 * total
    assert ((lo <= target + slack) & (target < hi + slack)).all()
    inner = sampled & (u > 1e-6) & (u < 1 - 1e-6)
    assert (got[inner] == ref[inner]).sum() >= 0.99 * inner.sum()


@needs_cpu_kernel
@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_draws_the_cdf_step_of_u(shape, dtype):
    x, temp, u, floor = _cases(shape, dtype)
    got = sample_logits_cpu(x, temp, u, floor)
    assert got is not None and got.dtype == torch.int64
    _assert_within_cdf_step(x, temp, u, floor, got)
    assert torch.equal(sample_logits(x, temp, u, floor), got)
    no_floor = torch.full_like(floor, -math.inf)
    _assert_within_cdf_step(x, temp, u, no_floor, sample_logits_cpu(x, temp, u))


@needs_cpu_kernel
@DTYPES
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_softmax_mass_matches_reference(shape, dtype):
    x, temp, _, floor = _cases(shape, dtype)
    x = x.masked_fill(x.isnan() | (x == math.inf), 0.0)  # finite maxima: the rows top-p asks about
    m, temp = x.float().amax(1), temp.clamp(min=0.1)
    ref = softmax_mass_ref(x, m, temp, floor)
    torch.testing.assert_close(softmax_mass(x, m, temp, floor), ref, rtol=1e-5, atol=0)
    assert torch.equal(softmax_mass(x, m, temp, floor)[:3], softmax_mass(x[:3], m[:3], temp[:3], floor[:3]))


@needs_cpu_kernel
def test_cpu_rows_are_batch_invariant():
    x, temp, u, floor = _cases((64, 4113), torch.float32, seed=3)
    batched = sample_logits_cpu(x, temp, u, floor)
    for b in (0, 9, 31, 63):
        alone = sample_logits_cpu(x[b : b + 1], temp[b : b + 1], u[b : b + 1], floor[b : b + 1])
        assert alone.item() == batched[b].item()


def _assert_chi_square(draws, probs):
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs * draws.numel()
    keep = expected > 5
    assert (counts[probs == 0] == 0).all()
    stat, df = float((((counts - expected) ** 2) / expected)[keep].sum()), int(keep.sum()) - 1
    # ~5 standard deviations above the chi-square mean (df, var 2 df): loose, with a fixed seed.
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpu", marks=needs_cpu_kernel)])
@pytest.mark.parametrize("vocab", [12, 700])  # 700: the draw walks several blocks of the C kernel
def test_draws_follow_the_softmax(impl, vocab):
    g = torch.Generator().manual_seed(11)
    n, temp = 60000, 0.8
    logits = torch.randn(vocab, generator=g) * (2.0 if vocab < 100 else 0.7)
    logits[torch.randperm(vocab, generator=g)[: vocab // 6]] = -math.inf
    x = logits.expand(n, vocab).contiguous()
    u = torch.rand(n, dtype=torch.float64, generator=g)
    fn = sample_logits_ref if impl == "ref" else sample_logits_cpu
    draws = fn(x, torch.full((n,), temp), u)
    _assert_chi_square(draws, (logits.double() / temp).softmax(0))
    lo = logits.sort(descending=True).values[vocab // 3]  # keep the top third (a truncation)
    draws = fn(x, torch.full((n,), temp), u, torch.full((n,), float(lo)))
    _assert_chi_square(draws, (logits.double() / temp).masked_fill(logits < lo, -math.inf).softmax(0))


@needs_cpu_kernel
def test_cpu_declines_what_it_cannot_take():
    t, u = torch.ones(2), torch.zeros(2, dtype=torch.float64)
    assert sample_logits_cpu(torch.randn(2, 0), t, u) is None
    assert sample_logits_cpu(torch.randn(2, 3, 4), t, u) is None
    assert sample_logits_cpu(torch.randn(2, 8, dtype=torch.float64), t, u) is None
    assert sample_logits(torch.randn(2, 8, dtype=torch.float64), t, u).shape == (2,)


def naive_top_p_floor(x, temp, top_p, kth):
    """float64 loop: the last logit of the shortest descending prefix of the survivors whose mass
    reaches top_p."""
    out = []
    for row, t, p, k in zip(x.double().tolist(), temp.tolist(), top_p.tolist(), kth.tolist(), strict=True):
        alive = [v for v in row if v >= k]
        m = max(alive, default=-math.inf)
        if p >= 1 or t <= 0 or any(v != v for v in row) or math.isinf(m):
            out.append(k)
            continue
        alive.sort(reverse=True)
        mass = [math.exp((v - m) / t) for v in alive]
        target, cum = p * sum(mass), 0.0
        out.append(next((v for v, e in zip(alive, mass, strict=True) if (cum := cum + e) >= target), alive[-1]))
    return torch.tensor(out, dtype=torch.float32)


def _top_p_cases(shape, dtype, seed=0):
    """Random rows (some -inf), temperatures 0.05-3 (some 0), top_p 0.01-1 (some 1), kth -inf or a
    row's 40th largest logit; special rows: NaN, all -inf, +inf, all equal, ties at the floor, a
    spread wider than the kernel's buckets."""
    b, n = shape
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(b, n + 3, generator=g))[:, :n]
    x[torch.rand(b, n, generator=g) < 0.2] = -math.inf
    temp = 0.05 + 3 * torch.rand(b, generator=g)
    temp[::9] = 0.0
    top_p = 0.01 + torch.rand(b, generator=g)
    top_p[::4] = 0.95
    kth = torch.full((b,), -math.inf)
    if n > 40:
        kth[1::3] = x[1::3].sort(dim=1, descending=True).values[:, 39]
    if b >= 8 and n > 5:
        x[2, 3] = math.nan
        x[3] = -math.inf
        x[4, 1] = math.inf
        x[5] = 1.5  # all equal: the top logit is the floor
        x[6, : n // 2] = x[6, 0]  # half the row tied
        x[7] = torch.linspace(-400, 0, n)  # far past the buckets' range
    return x.to(dtype), temp, top_p, kth


def _clear_of_steps(x, temp, top_p, kth, rel):
    """Rows whose target mass is not within `rel` of a CDF step (there float32 exps and sums may
    pick a neighbour): where kernel and reference must agree exactly. Special rows count as clear."""
    xd = x.double().masked_fill(x.double() < kth.double()[:, None], -math.inf)
    vals = xd.sort(dim=1, descending=True).values
    m = vals[:, :1]
    special = (temp <= 0) | (top_p >= 1) | x.isnan().any(dim=1) | ~m[:, 0].isfinite()
    t = torch.where(special, 1.0, temp.double())[:, None]
    mass = ((vals - torch.where(special[:, None], 0.0, m)) / t).exp().nan_to_num(0.0)
    cum, total = mass.cumsum(dim=1), mass.sum(dim=1, keepdim=True)
    gap = ((cum - top_p.double()[:, None] * total).abs() / total).amin(dim=1)
    return special | (gap > rel)


@DTYPES
@pytest.mark.parametrize("shape", [(1, 1), (9, 17), (9, 257), (16, 4113), (64, 49152)])
def test_top_p_floor_ref_matches_naive(shape, dtype):
    x, temp, top_p, kth = _top_p_cases(shape, dtype)
    if shape[1] > 5000:  # the naive loop is slow: a few rows
        x, temp, top_p, kth = x[:3], temp[:3], top_p[:3], kth[:3]
    want = naive_top_p_floor(x, temp, top_p, kth)
    ok = _clear_of_steps(x, temp, top_p, kth, rel=1e-9)
    torch.testing.assert_close(top_p_floor_ref(x, temp, top_p, kth)[ok], want[ok], rtol=0, atol=0)


@needs_cpu_kernel
@DTYPES
@pytest.mark.parametrize("shape", [(1, 1), (9, 17), (9, 257), (16, 4113), (16, 49152)])
def test_top_p_floor_cpu_matches_ref(shape, dtype):
    x, temp, top_p, kth = _top_p_cases(shape, dtype, seed=1)
    got, want = top_p_floor(x, temp, top_p, kth), top_p_floor_ref(x, temp, top_p, kth)
    ok = _clear_of_steps(x, temp, top_p, kth, rel=1e-5)
    assert ok.float().mean() > 0.6, "most rows must be checked exactly"
    torch.testing.assert_close(got[ok], want[ok], rtol=0, atol=0)
    # The rest land within rel 1e-5 of a CDF step: the kernel may take a neighbouring logit.
    for r in (~ok).nonzero().flatten().tolist():
        alive = x[r].float()[x[r].float() >= kth[r]].sort(descending=True).values
        here, there = (alive == got[r]).nonzero(), (alive == want[r]).nonzero()
        assert abs(int(here[0]) - int(there[0])) <= 8, (r, got[r], want[r])


@needs_cpu_kernel
def test_top_p_floor_cpu_rows_are_batch_invariant():
    x, temp, top_p, kth = _top_p_cases((32, 4113), torch.float32, seed=2)
    whole = top_p_floor(x, temp, top_p, kth)
    alone = torch.cat([top_p_floor(x[i : i + 1], temp[i : i + 1], top_p[i : i + 1], kth[i : i + 1])
                       for i in range(32)])
    torch.testing.assert_close(whole, alone, rtol=0, atol=0, equal_nan=True)


@needs_cpu_kernel
def test_top_p_floor_sampled_mass_reaches_top_p():
    """What the sampler keeps above the kernel's floor holds at least top_p of the mass, and without
    the floor's own logit less than top_p (the prefix is the shortest)."""
    g = torch.Generator().manual_seed(3)
    x = 4 * torch.randn(64, 49152, generator=g)
    temp, top_p = torch.full((64,), 1.0), torch.linspace(0.05, 0.99, 64)
    floor = top_p_floor(x, temp, top_p, torch.full((64,), -math.inf))
    p = (x.double() - x.double().amax(dim=1, keepdim=True)).exp()
    total = p.sum(dim=1)
    kept = (p * (x >= floor[:, None])).sum(dim=1) / total
    above = (p * (x > floor[:, None])).sum(dim=1) / total
    assert (kept >= top_p.double() - 1e-5).all() and (above < top_p.double() + 1e-5).all()
