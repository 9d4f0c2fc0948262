import pytest
import torch

from moebus.kernels.compressor import (
    compress_windows,
    compress_windows_cpu,
    compress_windows_ref,
    compress_windows_triton,
)

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
# (windows, slots, channels): CSA-like (2r = 8 slots), HCA-like (128), odd sizes (2^k + 17)
SHAPES = [(1, 8, 16), (5, 8, 81), (3, 128, 33), (17, 33, 145)]


def naive(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Float64 loops over windows and channels."""
    n, L, C = kv.shape
    out = torch.zeros(n, C, dtype=torch.float64)
    for w in range(n):
        for c in range(C):
            g = gate[w, :, c].double() + bias[:, c].double()
            e = torch.exp(g - g.max())
            out[w, c] = (e * kv[w, :, c].double()).sum() / e.sum()
    return out


def inputs(shape, dtype, device="cpu", mask_first=True):
    n, L, C = shape
    kv = torch.randn(shape, dtype=dtype, device=device)
    gate = (2 * torch.randn(shape, device=device)).to(dtype)
    if mask_first and L > 1:  # CSA's window 0: the overlap half has weight 0
        gate[0, : L // 2] = float("-inf")
    bias = 0.5 * torch.randn(L, C, device=device)
    return kv, gate, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_ref_and_cpu_match_fp64(shape, dtype, close):
    kv, gate, bias = inputs(shape, dtype)
    expected = naive(kv, gate, bias)
    ref = compress_windows_ref(kv, gate, bias)
    assert ref.dtype == dtype and ref.shape == (shape[0], shape[2])
    close(ref, expected, *TOL[dtype])
    cpu = compress_windows_cpu(kv, gate, bias)
    if cpu is None:
        pytest.skip("no C compiler: the CPU path is the reference")
    close(cpu, expected, *TOL[dtype])
    close(compress_windows(kv, gate, bias), expected, *TOL[dtype])


def test_masked_slots_get_no_weight(close):
    kv, gate, bias = inputs((2, 8, 16), torch.float32)
    kv_poisoned = kv.clone()
    kv_poisoned[0, :4] = 1e6  # masked slots: their values must not leak in
    close(compress_windows(kv_poisoned, gate, bias), compress_windows(kv, gate, bias), 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_ref(shape, dtype, triton_device, close):
    kv, gate, bias = inputs(shape, dtype, triton_device)
    close(compress_windows_triton(kv, gate, bias), compress_windows_ref(kv, gate, bias), *TOL[dtype])
