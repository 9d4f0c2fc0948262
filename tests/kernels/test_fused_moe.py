import pytest
import torch

from moebus.kernels import fused_moe, fused_moe_ref, fused_moe_triton, moe_align
from moebus.kernels.fused_moe import CPU_MAX_TOKENS, fused_moe_cpu
from moebus.kernels.paged_attention import cpu_kernel_available

# bf16: both paths round each GEMM output and the activation to bf16 (3 roundings per value).
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (4e-2, 4e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (T, D, I, E, k): single token (most experts empty), odd D / I (2^k + 17), top-1..4.
CASES = [(1, 64, 32, 4, 2), (17, 81, 48, 8, 2), (33, 64, 81, 6, 4), (17, 145, 64, 3, 1)]


def make_inputs(case, dtype, device="cpu"):
    t, d, i, e, k = case
    x = torch.randn(t, d, dtype=dtype, device=device)
    w13 = (torch.randn(e, 2 * i, d, device=device) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, i, device=device) * i ** -0.5).to(dtype)
    topk_ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32).to(device)
    topk_weights = torch.softmax(torch.randn(t, k, device=device), -1)
    return x, w13, w2, topk_weights, topk_ids


def naive_moe(x, w13, w2, topk_weights, topk_ids, limit=None):
    t, d = x.shape
    inter = w2.shape[-1]
    out = torch.zeros(t, d, dtype=torch.float64)
    for tok in range(t):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[tok, j])
            h = w13[e].double() @ x[tok].double()
            gate, up = h[:inter], h[inter:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[tok] += topk_weights[tok, j].double() * (w2[e].double() @ (gate * torch.sigmoid(gate) * up))
    return out


@DTYPES
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("limit", [None, 0.5])
def test_ref_matches_fp64(case, dtype, limit, close):
    x, w13, w2, tw, ids = make_inputs(case, dtype)
    out = fused_moe_ref(x, w13, w2, tw, ids, swiglu_limit=limit)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, naive_moe(x, w13, w2, tw, ids, limit), *TOL[dtype])


@DTYPES
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("block_m", [16, None])  # None: the launcher's own choice (64 for T*k > 4E)
def test_triton_matches_ref(case, dtype, limit, block_m, triton_device, close):
    x, w13, w2, tw, ids = make_inputs(case, dtype, triton_device)
    out = fused_moe_triton(x, w13, w2, tw, ids, swiglu_limit=limit, block_m=block_m)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, fused_moe_ref(x, w13, w2, tw, ids, swiglu_limit=limit), *TOL[dtype])


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("t,k,e", [(1, 2, 8), (33, 4, 6), (17, 1, 3)])
def test_moe_align(t, k, e, block_m):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    sorted_ids, expert_ids, num_padded = moe_align(ids, e, block_m)
    n = t * k
    flat = ids.reshape(-1)
    total = int(num_padded)
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    assert total % block_m == 0 and total <= sorted_ids.numel()
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // block_m:] == -1).all()
    real = sorted_ids[:total][sorted_ids[:total] < n]
    assert sorted(real.tolist()) == list(range(n))  # every assignment exactly once
    for blk in range(total // block_m):  # each block holds one expert's assignments, in order
        ids_blk = sorted_ids[blk * block_m:(blk + 1) * block_m]
        ids_blk = ids_blk[ids_blk < n]
        assert (flat[ids_blk.long()] == expert_ids[blk]).all()
        assert ids_blk.tolist() == sorted(ids_blk.tolist())
    counts = torch.bincount(flat, minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
@DTYPES
@pytest.mark.parametrize("case", [*CASES, (64, 128, 64, 16, 2)])  # the last: the tiny bench MoE's shapes
@pytest.mark.parametrize("limit", [None, 0.5])
def test_cpu_matches_ref(case, dtype, limit, close):
    x, w13, w2, tw, ids = make_inputs(case, dtype)
    out = fused_moe_cpu(x, w13, w2, tw, ids, swiglu_limit=limit)
    assert out is not None and out.shape == x.shape and out.dtype == dtype
    close(out, fused_moe_ref(x, w13, w2, tw, ids, swiglu_limit=limit), *TOL[dtype])
    close(out, naive_moe(x, w13, w2, tw, ids, limit), *TOL[dtype])


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C compiler for the CPU kernels")
def test_cpu_strided_tokens_and_declines(close):
    x, w13, w2, tw, ids = make_inputs((17, 81, 48, 8, 2), torch.float32)
    wide = torch.randn(17, 100)
    wide[:, :81] = x
    close(fused_moe_cpu(wide[:, :81], w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids), *TOL[torch.float32])
    assert fused_moe_cpu(x, w13, w2, tw, torch.full_like(ids, 8)) is None  # expert id out of range
    assert fused_moe_cpu(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, tw, ids) is None
    assert fused_moe_cpu(x.double(), w13.double(), w2.double(), tw, ids) is None
    big = make_inputs((CPU_MAX_TOKENS + 1, 512, 256, 4, 2), torch.float32)  # 1.5 MiB experts
    assert fused_moe_cpu(*big) is None
    close(fused_moe_cpu(*big, max_tokens=None), fused_moe_ref(*big), *TOL[torch.float32])  # deterministic mode
    small = make_inputs((CPU_MAX_TOKENS + 1, 16, 8, 4, 2), torch.float32)  # cache-resident experts: any size
    close(fused_moe_cpu(*small), fused_moe_ref(*small), *TOL[torch.float32])


def test_dispatch_cpu():
    x, w13, w2, tw, ids = make_inputs((17, 81, 48, 8, 2), torch.bfloat16)
    expected = fused_moe_cpu(x, w13, w2, tw, ids, 0.5) if cpu_kernel_available() else None
    if expected is None:
        expected = fused_moe_ref(x, w13, w2, tw, ids, 0.5)
    assert torch.equal(fused_moe(x, w13, w2, tw, ids, swiglu_limit=0.5), expected)
    assert torch.equal(fused_moe(x, w13, w2, tw, ids.long(), swiglu_limit=0.5), expected)
    big = make_inputs((CPU_MAX_TOKENS + 1, 512, 256, 4, 2), torch.float32)
    assert torch.equal(fused_moe(*big), fused_moe_ref(*big))  # prefill-sized, large experts: the reference
    empty = fused_moe(x[:0], w13, w2, tw[:0], ids[:0])
    assert empty.shape == (0, x.shape[1])


# The panel kernel's shapes: D and I multiples of 32 (bf16 takes k in pairs of 16-column panels).
PANEL_CASES = [(1, 64, 32, 4, 2), (13, 96, 64, 8, 3), (40, 128, 96, 16, 4), (64, 128, 64, 16, 2), (7, 64, 32, 3, 1)]


def panels_or_skip(w13, w2):
    from moebus.kernels.fused_moe import ExpertPanels

    packed = ExpertPanels().get(w13, w2)
    if packed is None:
        pytest.skip("the panel kernel needs AVX-512 (float32) / AVX512-BF16 (bf16)")
    return packed


@DTYPES
@pytest.mark.parametrize("case", PANEL_CASES)
@pytest.mark.parametrize("limit", [None, 0.5])
def test_panels_match_ref_and_fp64(case, dtype, limit, close):
    from moebus.kernels.fused_moe import fused_moe_panels_cpu

    x, w13, w2, tw, ids = make_inputs(case, dtype)
    out = fused_moe_panels_cpu(x, panels_or_skip(w13, w2), tw, ids, case[2], swiglu_limit=limit)
    assert out is not None and out.shape == x.shape and out.dtype == dtype
    close(out, fused_moe_ref(x, w13, w2, tw, ids, swiglu_limit=limit), *TOL[dtype])
    close(out, naive_moe(x, w13, w2, tw, ids, limit), *TOL[dtype])


@DTYPES
def test_panels_are_batch_invariant_and_follow_weight_changes(dtype):
    """A token's output is bitwise the same alone or among others; writing the weights in place (as
    an EPLB move does) repacks them."""
    from moebus.kernels.fused_moe import ExpertPanels

    x, w13, w2, tw, ids = make_inputs((40, 128, 96, 16, 4), dtype)
    panels = ExpertPanels()
    panels_or_skip(w13, w2)
    crowd = fused_moe(x, w13, w2, tw, ids, panels=panels)
    for t in (0, 17, 39):
        alone = fused_moe(x[t:t + 1], w13, w2, tw[t:t + 1], ids[t:t + 1], panels=panels)
        assert torch.equal(alone[0], crowd[t])
    w2[3].mul_(2)  # in place: the packed copy is stale
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ids, panels=panels).float(), ref.float(),
                               atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_panels_decline_what_they_cannot_take():
    from moebus.kernels.fused_moe import ExpertPanels, fused_moe_panels_cpu

    x, w13, w2, tw, ids = make_inputs((5, 81, 48, 8, 2), torch.float32)  # D = 81: not in 16-column panels
    assert ExpertPanels().get(w13, w2) is None
    x, w13, w2, tw, ids = make_inputs((5, 64, 32, 4, 2), torch.float32)
    packed = panels_or_skip(w13, w2)
    assert fused_moe_panels_cpu(x, packed, tw, ids.long() + 4, 32) is None  # an expert id out of range
