"""The LM head in float32: greedy tokens (argmax_n (x @ w.T)[m, n] without the [M, N] logits) and
the float32 logits themselves (lm_head_logits), from weights in any storage dtype.

The logits are float32 sums that are never rounded to the storage dtype (bf16's 8-bit mantissa
steps by 0.125 at a logit of 25: near-ties became exact ties, and the lower token id won). The
tie rule is torch's `max(dim=1).indices` on those float32 logits: the first maximum of each row,
and a row holding a NaN gives its first NaN. The kernels differ from the references only in
summation order, so a near-tie (a few float32 ulps) can resolve the other way.

Why: in greedy decoding the vocabulary GEMM is the largest op of a small model's step (SmolLM2's
tiny-MoE bench: [64, 128] x [49152, 128] through oneDNN, plus writing the 12.6 MB of logits and
reading them back for the argmax). The kernels keep a running best per
row instead. Each row's result is independent of the other rows in the call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._compat import check_launchable, next_pow2, tl, triton, upcast_dots, use_triton
from .cpu_build import I32, I64, PTR, library, on_cpu

_CPU_ARGTYPES = [PTR, I64, PTR, I64, I64, I32, I32, PTR]
_CPU_LOGITS_ARGTYPES = [PTR, I64, PTR, I64, I64, I32, I32, PTR, I64]


def lm_head_logits_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    return F.linear(x.float(), w.float())


def lm_head_argmax_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return lm_head_logits_ref(x, w).max(dim=1).indices


@triton.jit
def _lm_head_argmax_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, w_stride,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # BLOCK_M rows per program; the vocabulary in BLOCK_N tiles, each the float32 dot over K in
    # BLOCK_K steps, folded into a running (max, first index, first NaN).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols0 = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    big = N + BLOCK_N
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_M,), tl.int64)
    first_nan = tl.full((BLOCK_M,), big, tl.int64)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + cols0
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + k[None, :],
                        mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * w_stride + k[:, None],
                        mask=col_ok[None, :] & (k[:, None] < K), other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        logits = acc
        is_nan = (logits != logits) & col_ok[None, :]
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols[None, :].to(tl.int64), big), axis=1))
        logits = tl.where(col_ok[None, :] & ~is_nan, logits, float("-inf"))
        tile_max = tl.max(logits, axis=1)
        tile_idx = tl.min(tl.where((logits == tile_max[:, None]) & col_ok[None, :], cols[None, :].to(tl.int64), big),
                          axis=1)
        best_idx = tl.where(tile_max > best, tile_idx, best_idx)
        best = tl.maximum(best, tile_max)
    tl.store(out_ptr + rows, tl.where(first_nan < big, first_nan, best_idx), mask=row_ok)


def lm_head_argmax_triton(x: torch.Tensor, w: torch.Tensor, *, block_m: int = 16, block_n: int = 64,
                          block_k: int | None = None) -> torch.Tensor:
    check_launchable(x, w)
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype == w.dtype and x.stride(1) == 1 and w.stride(1) == 1, (x.dtype, w.dtype)
    m, k = x.shape
    out = torch.zeros(m, dtype=torch.int64, device=x.device)
    if m == 0 or w.shape[0] == 0:
        return out
    block_k = block_k or min(max(next_pow2(k), 16), 64)
    _lm_head_argmax_kernel[(triton.cdiv(m, block_m),)](x, w, out, m, w.shape[0], k, x.stride(0), w.stride(0),
                                                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                       UPCAST=upcast_dots(x.dtype),
                                                       PRECISION="ieee" if x.dtype == torch.float32 else None)
    return out


PANEL = 16  # vocabulary rows per panel of the C kernel's weight layout
BF16_K_ALIGN = 32  # bf16 panels are padded in K to whole AMX tile rows (32 bf16)
# The C kernel's paths (its `isa` argument): "auto" picks the best one the CPU and build have; "fma"
# float32 FMA tiles, AVX-512 where built; "fma256" the AVX2 (or scalar) ones; bf16 only: vdpbf16ps
# ("avx512_bf16") and AMX tiles.
ISAS = {"auto": 0, "fma": 1, "avx512_bf16": 2, "amx": 3, "fma256": 4}
_DTYPE_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def panels_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    if dtype == torch.bfloat16:
        return -(-n // PANEL), -(-k // BF16_K_ALIGN) * BF16_K_ALIGN // 2, 2 * PANEL
    return -(-n // PANEL), k, PANEL


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] (zero rows past N): the C kernel's layout, in which a panel's
    16 columns at one k are contiguous. bf16: [ceil(N / 16), Kp / 2, 32], k in pairs (a panel's
    (w[n, 2i], w[n, 2i + 1]) for its 16 n at pair i, Kp = K rounded up to 32 with zeros): AMX's and
    vdpbf16ps's operand layout. A copy: pack once per weight, as PackedLinear does."""
    n, k = w.shape
    if w.dtype == torch.bfloat16:
        padded = F.pad(w.detach(), (0, -k % BF16_K_ALIGN, 0, -n % PANEL))
        return padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).reshape(panels_shape(n, k, w.dtype))
    padded = F.pad(w.detach(), (0, 0, 0, -n % PANEL))
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_panels' inverse: the [n, k] weight (a copy)."""
    if panels.dtype == torch.bfloat16:
        p, half, _ = panels.shape
        return panels.view(p, half, PANEL, 2).transpose(1, 2).reshape(p * PANEL, 2 * half)[:n, :k].contiguous()
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n, :k].contiguous()


def isas(dtype: torch.dtype) -> list[str]:
    """The paths (ISAS, less "auto") the C kernel can run for `dtype` on this CPU and build."""
    lib = library("lm_head_argmax_cpu.c").get()
    bits = lib.lm_head_argmax_isas(_DTYPE_ID[dtype]) if lib is not None and dtype in _DTYPE_ID else 0
    return [name for name, i in ISAS.items() if i and bits >> i & 1]


def _cpu_call(entry: str, x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None, isa: str,
              out: torch.Tensor, *out_stride: int) -> torch.Tensor | None:
    """One of csrc/lm_head_argmax_cpu.c's entries into `out`; None when it does not apply."""
    if not (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and w.shape[0] > 0 and on_cpu(x, w)):
        return None
    fn = library("lm_head_argmax_cpu.c").function(entry, x.dtype,
                                                  _CPU_LOGITS_ARGTYPES if out_stride else _CPU_ARGTYPES)
    if fn is None:
        return None
    if panels is None:
        panels = pack_panels(w)
    n, k = w.shape
    assert panels.shape == panels_shape(n, k, x.dtype) and panels.dtype == x.dtype and panels.is_contiguous()
    status = fn(x.data_ptr(), x.stride(0), panels.data_ptr(), x.shape[0], n, k, ISAS[isa], out.data_ptr(),
                *out_stride)
    return out if status == 0 else None


def lm_head_argmax_cpu(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None, *,
                       isa: str = "auto") -> torch.Tensor | None:
    """The C kernel in csrc/lm_head_argmax_cpu.c; None when it does not apply. `panels` is
    pack_panels(w), packed here when not given; `isa`: the kernel's path (ISAS)."""
    return _cpu_call("lm_head_argmax", x, w, panels, isa, torch.empty(x.shape[0], dtype=torch.int64))


def lm_head_logits_cpu(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None, *,
                       isa: str = "auto") -> torch.Tensor | None:
    """[M, N] float32 logits by the same kernel's tiles (AMX, vdpbf16ps or FMA); as lm_head_argmax_cpu."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    return _cpu_call("lm_head_logits", x, w, panels, isa, out, out.stride(0))


def lm_head_logits(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] in one dtype -> [M, N] float32 logits, never rounded to the storage dtype."""
    out = lm_head_logits_cpu(x, w, panels) if x.dtype == w.dtype else None
    return out if out is not None else lm_head_logits_ref(x, w)


def lm_head_argmax(x: torch.Tensor, w: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] (an LM head's weight) -> [M] int64 greedy token ids. `panels`: the CPU
    kernel's pack_panels(w), to pack once rather than per call."""
    if use_triton(x) and x.stride(-1) == 1 and w.stride(-1) == 1 and x.dtype == w.dtype:
        return lm_head_argmax_triton(x, w)
    out = lm_head_argmax_cpu(x, w, panels)
    return out if out is not None else lm_head_argmax_ref(x, w)
