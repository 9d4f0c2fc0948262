import pytest
import torch

from moebus.kernels import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(1, 128), (17, 162), (33, 290), (2, 3, 128)]  # I = 64, 81, 145 (2^k + 17)


def naive_silu_and_mul(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    x = x.double()
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter], x[..., inter:]
    if limit is not None:
        gate = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
        up = torch.clamp(up, -limit, limit)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("limit", [None, 7.0])
def test_ref_matches_fp64(shape, dtype, limit, close):
    x = torch.randn(shape, dtype=dtype) * 5  # wide enough that a limit of 7 clamps
    out = silu_and_mul_ref(x, limit=limit)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    close(out, naive_silu_and_mul(x, limit), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("limit", [None, 7.0])
def test_triton_matches_ref(shape, dtype, limit, triton_device, close):
    x = torch.randn(shape, dtype=dtype, device=triton_device) * 5
    close(silu_and_mul_triton(x, limit=limit), silu_and_mul_ref(x, limit=limit), *TOL[dtype])


def test_limit_clamps():
    x = torch.tensor([[100.0, -100.0, 100.0, 100.0]])  # gates (100, -100), ups (100, 100)
    out = silu_and_mul_ref(x, limit=7.0)
    expected = torch.tensor([[7.0 * torch.sigmoid(torch.tensor(7.0)).item() * 7.0, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
