import math

import pytest
import torch

from moebus.kernels import apply_rotary, apply_rotary_ref, apply_rotary_triton, rotary_cos_sin

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
# (T, Hq, Hk, D, R): full and partial rotary, odd head dims (2^k + 17), GQA-style head counts.
CASES = [(1, 4, 4, 64, 64), (17, 8, 2, 64, 32), (33, 4, 1, 81, 80), (17, 2, 2, 145, 64)]
BASE = 10000.0


def naive_cos_sin(positions: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.tensor([[p * BASE ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
                        for p in positions.tolist()], dtype=torch.float64)
    return ang.cos(), ang.sin()


def naive_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    out = x.double().clone()
    half = cos.shape[1]
    c, s = cos.double()[:, None], sin.double()[:, None]
    for i in range(half):  # pair channel i with channel i + R/2 (neox layout)
        a, b = x[..., i].double(), x[..., half + i].double()
        out[..., i] = a * c[..., i] - b * s[..., i]
        out[..., half + i] = b * c[..., i] + a * s[..., i]
    return out


def _inputs(case, dtype, device="cpu", views=False):
    t, hq, hk, d, r = case
    if views:  # q and k as strided views of one fused qkv projection, as models produce them
        qkv = torch.randn(t, hq + 2 * hk, d, dtype=dtype, device=device)
        q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    else:
        q = torch.randn(t, hq, d, dtype=dtype, device=device)
        k = torch.randn(t, hk, d, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (t,), device=device)
    cos, sin = rotary_cos_sin(positions, r, BASE, torch.float32)
    return q, k, cos, sin, positions


def test_cos_sin_matches_fp64(close):
    positions = torch.tensor([0, 1, 7, 255, 4095])
    cos, sin = rotary_cos_sin(positions, 80, BASE, torch.float32)
    ncos, nsin = naive_cos_sin(positions, 80)
    assert cos.shape == (5, 40) and cos.dtype == torch.float32
    # fp32 inv_freq has ~6e-8 relative error; at position 4095 that is ~3e-4 rad of angle.
    close(cos, ncos, 5e-4, 0)
    close(sin, nsin, 5e-4, 0)
    assert rotary_cos_sin(positions, 80, BASE, torch.bfloat16)[0].dtype == torch.bfloat16
    assert math.isclose(cos[0, 0].item(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_ref_matches_fp64(case, dtype, close):
    q, k, cos, sin, _ = _inputs(case, dtype)
    q_out, k_out = apply_rotary_ref(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    close(q_out, naive_rotary(q, cos, sin), *TOL[dtype])
    close(k_out, naive_rotary(k, cos, sin), *TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("views", [False, True])
def test_triton_matches_ref(case, dtype, views, triton_device, close):
    q, k, cos, sin, _ = _inputs(case, dtype, triton_device, views)
    q_out, k_out = apply_rotary_triton(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    close(q_out, q_ref, *TOL[dtype])
    close(k_out, k_ref, *TOL[dtype])


def test_rotation_preserves_pair_norms():
    q, k, cos, sin, _ = _inputs((17, 4, 2, 64, 64), torch.float32)
    q_out, _ = apply_rotary(q, k, cos, sin)
    pair = lambda x: x[..., :32] ** 2 + x[..., 32:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(q_out), pair(q), atol=1e-4, rtol=1e-4)
