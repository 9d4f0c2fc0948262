"""One token per row from softmax(logits / T), by inversion of the CDF with one uniform per row.

    sample_logits(x [B, V], temperature [B] float32, u [B] float64 in [0, 1), floor [B] | None) -> [B] int64

Row b takes the first v whose running sum of p_v = exp((x_v - max_b) / T_b) exceeds u_b * sum(p),
where p_v = 0 for x_v < floor_b (a truncation: top-k, top-p and min-p each keep the logits at or
above some value): a draw from the truncated softmax when u_b ~ U[0, 1), and a deterministic
function of (row, T, u, floor), so the caller owns all randomness (a seeded request draws its u from
its own generator) and the token of a row never depends on the other rows. Masked logits (-inf)
have no mass and are never drawn. Rows with T <= 0 (greedy), a NaN, an infinite max or a floor
above the max take the row argmax instead: torch's `max(dim=1).indices`, the first maximum or the
first NaN (a +inf logit holds all the mass).

Why: the sampler's torch path (float32 copy, softmax, [B, V] Exp(1) noise from torch's scalar
exponential_, exponential race) was slow at B=64 over a 49152-token vocabulary on one core;
the C kernel reads each row twice with a vectorised exp. Its exp (cpu_common.h fast_exp) is within
~2 ulp and its sums are float32 per block of 256, float64 across, so the token can differ from the
float64 reference only when u_b lands within ~1e-6 (relative) of a CDF step.
"""
from __future__ import annotations

import math

import torch

from .argmax import row_argmax_ref
from .cpu_build import I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, I64, I64, PTR, PTR, PTR, PTR]
_MASS_ARGTYPES = [PTR, I64, I64, I64, PTR, PTR, PTR, PTR]


def sample_logits_ref(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                      floor: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of the semantics above."""
    assert x.dim() == 2 and temperature.shape == u.shape == x.shape[:1], (x.shape, temperature.shape, u.shape)
    first_max = row_argmax_ref(x)
    xd = x.double()
    m = xd.amax(dim=1)  # NaN when the row has one
    lo = torch.full_like(m, -math.inf) if floor is None else floor.double()
    special = (temperature <= 0) | ~m.isfinite() | ~(lo <= m)
    t = torch.where(special, 1.0, temperature.double())
    p = ((xd - torch.where(special, 0.0, m).unsqueeze(1)) / t.unsqueeze(1)).exp()
    p = p.masked_fill(xd < lo.unsqueeze(1), 0.0)
    cdf = p.cumsum(dim=1)
    target = (u.double() * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
    return torch.where(special, first_max, drawn)


def sample_logits_cpu(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                      floor: torch.Tensor | None = None) -> torch.Tensor | None:
    """The C kernel in csrc/sample_cpu.c; None when it does not apply."""
    if x.dim() != 2 or x.shape[1] == 0 or not on_cpu(x) or temperature.device.type != "cpu":
        return None
    fn = library("sample_cpu.c").function("sample_logits", x.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    temp = temperature.to(torch.float32).contiguous()
    u64 = u.to(torch.float64).contiguous()
    lo = None if floor is None else floor.to(torch.float32).contiguous()
    assert temp.shape == u64.shape == x.shape[:1] and (lo is None or lo.shape == temp.shape), (x.shape, temp.shape)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    status = fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], temp.data_ptr(), u64.data_ptr(),
                None if lo is None else lo.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def softmax_mass_ref(x: torch.Tensor, m: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """`[B]` float64: sum of exp((x_v - m_b) / T_b) over x_v >= floor_b, the normaliser of the truncated
    softmax sample_logits draws from (m_b: the row max; top-p needs the mass of its survivors)."""
    xd = x.double()
    p = ((xd - m.double().unsqueeze(1)) / temperature.double().unsqueeze(1)).exp()
    return p.masked_fill(xd < floor.double().unsqueeze(1), 0.0).sum(dim=1)


def _per_row_cpu(name: str, x: torch.Tensor, rows: tuple[torch.Tensor, ...],
                 out_dtype: torch.dtype) -> torch.Tensor | None:
    """csrc/sample_cpu.c's `name` over x [B, N] with three [B] float32 row parameters into a new [B]
    tensor of out_dtype; None where it does not apply (off the CPU, no library) or it refuses."""
    if not (x.dim() == 2 and x.shape[1] and on_cpu(x) and all(t.device.type == "cpu" for t in rows)):
        return None
    fn = library("sample_cpu.c").function(name, x.dtype, _MASS_ARGTYPES)
    if fn is None:
        return None
    args = [t.to(torch.float32).contiguous() for t in rows]
    assert all(a.shape == x.shape[:1] for a in args), (x.shape, [a.shape for a in args])
    out = torch.empty(x.shape[0], dtype=out_dtype)
    status = fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], *(a.data_ptr() for a in args), out.data_ptr())
    return out if status == 0 else None


def softmax_mass(x: torch.Tensor, m: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """softmax_mass_ref; the C kernel on CPU (one vectorised pass, float32 per block of 256)."""
    out = _per_row_cpu("softmax_mass", x, (m, temperature, floor), torch.float64)
    return out if out is not None else softmax_mass_ref(x, m, temperature, floor)


def sample_logits(x: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                  floor: torch.Tensor | None = None) -> torch.Tensor:
    out = sample_logits_cpu(x, temperature, u, floor)
    return out if out is not None else sample_logits_ref(x, temperature, u, floor)


def top_p_floor_ref(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    kth: torch.Tensor) -> torch.Tensor:
    """`[B]` float32, float64 reference: over the logits at or above kth_b (top-k's floor, or -inf),
    with p_v = exp((x_v - max) / T_b), the largest logit value v whose set {x >= v} holds at least
    top_p_b of the mass: the last logit of the shortest prefix by descending logit whose mass
    reaches top_p (the sampler keeps every logit at or above it, ties included). Rows with top_p >= 1,
    T <= 0, a NaN, an infinite max or no survivor give kth."""
    xd, kd = x.double(), kth.double().unsqueeze(1)
    alive = xd >= kd
    m = xd.masked_fill(~alive, -math.inf).amax(dim=1)
    special = (top_p >= 1) | (temperature <= 0) | x.isnan().any(dim=1) | ~m.isfinite()
    t = torch.where(special, 1.0, temperature.double()).unsqueeze(1)
    p = ((xd - torch.where(special, 0.0, m).unsqueeze(1)) / t).exp().masked_fill(~alive, 0.0)
    vals, order = xd.masked_fill(~alive, -math.inf).sort(dim=1, descending=True, stable=True)
    cum = p.gather(1, order).cumsum(dim=1)
    target = (top_p.double() * p.sum(dim=1)).unsqueeze(1)
    first = (cum < target).sum(dim=1, keepdim=True).clamp_(max=x.shape[1] - 1)
    return torch.where(special, kth.float(), vals.gather(1, first).squeeze(1).float())


def top_p_floor(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
    """top_p_floor_ref; the C kernel on CPU (csrc/sample_cpu.c: no sort of the rows, float32 exps)."""
    out = _per_row_cpu("top_p_floor", x, (temperature, top_p, kth), torch.float32)
    return out if out is not None else top_p_floor_ref(x, temperature, top_p, kth)
