"""Linear layers on GGUF weight-only quantized weights: out = x @ dequantize(w).T, dequantized inside
the kernel.

w is a uint8 tensor [N, K / 32 * block bytes]: each row is its K / 32 GGUF blocks exactly as the
file stores them (ggml's layouts, so the loader's bytes are used as they are):

| type | block | weight |
| --- | --- | --- |
| Q4_0 | f16 d, 16 bytes of nibbles | d * (q - 8) |
| Q4_1 | f16 d, f16 m, 16 bytes of nibbles | d * q + m |
| Q8_0 | f16 d, 32 int8 | d * q |

Byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).

Why: a decode step reads every weight once. The shipped SmolLM2 is Q4_1 (token embedding / tied
LM head Q8_0): dequantized to float32 a token reads ~540 MB, served from the blocks ~96 MB.
Results are the reference's (float32 GEMM on the dequantized weight) up to summation order.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._compat import check_launchable, tl, triton, use_triton
from .cpu_build import I32, I64, PTR, library

QK = 32  # weights per block
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # name -> ggml type id (the GGUF tensor type)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# Rows from which the C kernel dequantizes panels of the weight and runs register-tiled GEMMs;
# fewer rows multiply each decoded block straight into every row (decode steps).
CPU_TILED_MIN_ROWS = 4
_CPU_ARGTYPES = [I32, PTR, I64, PTR, I64, I64, I64, I64, PTR, I64, I32]
_NO_TILES = 2**31 - 1


def check_weight(w: torch.Tensor, qtype: str, k: int) -> None:
    assert qtype in BLOCK_BYTES, f"unsupported quant type {qtype!r} (one of {sorted(BLOCK_BYTES)})"
    assert k % QK == 0, f"K={k} is not a multiple of {QK}"
    assert w.dtype == torch.uint8 and w.dim() == 2 and w.shape[1] == k // QK * BLOCK_BYTES[qtype], (w.shape, qtype, k)


def _halves(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes (little-endian f16) -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def dequantize_ref(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """[N, blocks bytes] -> float32 [N, K], the arithmetic of gguf-py's dequantize."""
    check_weight(w, qtype, k)
    blocks = w.view(w.shape[0], k // QK, BLOCK_BYTES[qtype])
    d = _halves(blocks[..., :2])
    if qtype == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).view(w.shape[0], k)
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)
    if qtype == "Q4_1":
        return (d * q.float() + _halves(blocks[..., 2:4])).view(w.shape[0], k)
    return (d * (q.to(torch.int8) - 8).float()).view(w.shape[0], k)


def quant_matmul_ref(x: torch.Tensor, w: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T -> [M, N] in x's dtype (float32 GEMM)."""
    return F.linear(x.float(), dequantize_ref(w, qtype, x.shape[-1])).to(x.dtype)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, NB, x_stride, w_stride, out_stride,
                         QTYPE: tl.constexpr, BB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program: BLOCK_M x rows by BLOCK_N weight rows; K in steps of one GGUF block (32), each
    # dequantized from its bytes in registers: the d (and m) halves rebuilt from two bytes, the
    # 32 quants gathered as element j = byte j % 16, nibble j // 16 (Q4) or byte j (Q8_0).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    j = tl.arange(0, 32)
    wrow = w_ptr + cols.to(tl.int64) * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b in range(0, NB):
        blk = wrow + b * BB
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + b * 32 + j[None, :], mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
        d0 = tl.load(blk, mask=col_ok, other=0).to(tl.uint16)
        d1 = tl.load(blk + 1, mask=col_ok, other=0).to(tl.uint16)
        d = (d0 | (d1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        if QTYPE == 8:
            q = tl.load(blk[None, :] + 2 + j[:, None], mask=col_ok[None, :], other=0)
            wt = q.to(tl.int8, bitcast=True).to(tl.float32) * d[None, :]
        else:
            QOFF: tl.constexpr = 4 if QTYPE == 3 else 2
            byte = tl.load(blk[None, :] + QOFF + (j[:, None] % 16), mask=col_ok[None, :], other=0)
            q = ((byte >> ((j[:, None] // 16) * 4).to(tl.uint8)) & 15).to(tl.int32)
            if QTYPE == 3:
                m0 = tl.load(blk + 2, mask=col_ok, other=0).to(tl.uint16)
                m1 = tl.load(blk + 3, mask=col_ok, other=0).to(tl.uint16)
                m = (m0 | (m1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
                wt = d[None, :] * q.to(tl.float32) + m[None, :]
            else:
                wt = d[None, :] * (q - 8).to(tl.float32)
        acc = tl.dot(a, wt, acc, input_precision="ieee")  # [BM, 32] x [32, BN]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quant_matmul_triton(x: torch.Tensor, w: torch.Tensor, qtype: str, *, block_m: int = 16,
                        block_n: int = 32) -> torch.Tensor:
    check_launchable(x, w)
    m, k = x.shape
    check_weight(w, qtype, k)
    assert x.stride(1) == 1 and w.stride(1) == 1
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](x, w, out, m, n, k // QK, x.stride(0), w.stride(0), out.stride(0),
                               QTYPE=GGML_TYPES[qtype], BB=BLOCK_BYTES[qtype], BLOCK_M=block_m, BLOCK_N=block_n)
    return out


def cpu_kernel_available() -> bool:
    return cpu_function() is not None


def cpu_function() -> Callable[..., int] | None:
    return library("quant_matmul_cpu.c").function("quant_matmul", torch.float32, _CPU_ARGTYPES)


def quant_matmul_cpu_unchecked(fn: Callable[..., int], x: torch.Tensor, w: torch.Tensor, qtype_id: int,
                               one_path: bool) -> torch.Tensor | None:
    """The C call alone, for callers that checked once what quant_matmul_cpu checks per call (a
    batch-1 decode step makes ~120 of these calls: Python work per call is per-token latency)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    status = fn(qtype_id, x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), m, n, k, out.data_ptr(), n,
                _NO_TILES if one_path else CPU_TILED_MIN_ROWS)
    return out if status == 0 else None


def quant_matmul_cpu(x: torch.Tensor, w: torch.Tensor, qtype: str, *, one_path: bool = False) -> torch.Tensor | None:
    """The C kernel in csrc/quant_matmul_cpu.c (float32 x); None when it does not apply. one_path:
    every row count takes the same (direct) path, so a row's result never depends on the batch."""
    if not (x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1
            and w.device.type == "cpu" and w.is_contiguous() and qtype in GGML_TYPES):
        return None
    check_weight(w, qtype, x.shape[1])
    fn = cpu_function()
    return None if fn is None else quant_matmul_cpu_unchecked(fn, x, w, GGML_TYPES[qtype], one_path)


# Integer activations (csrc/quant_dot_cpu.c): the activation row is quantized once per call to
# int8 (as llama.cpp) or int16 blocks of 32 (a float scale d, and d * sum of the block's quants for
# Q4's offset term) and every weight block is an integer dot: fewer conversions per block than
# decoding it to floats (BENCHMARKS.md). Results move by the activation's rounding, up to d / 2 an
# element, d = max |x| of its block / 127 (8 bits) or / 32767 (16 bits).
ACT_BITS = (8, 16)
_QA_ARGTYPES = [I32, *_CPU_ARGTYPES[:-1]]


def quantize_act_ref(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [M, K] -> (q int8/int16 [M, K], d float32 [M, K / 32], d * sum(q) float32 [M, K / 32]),
    the C kernel's arithmetic: d = max|x| / qmax, q = round-half-even(x * (1 / d)), q = 0 when d = 0."""
    assert bits in ACT_BITS, bits
    m, k = x.shape
    assert k % QK == 0, f"K={k} is not a multiple of {QK}"
    xb = x.float().reshape(m, k // QK, QK)
    d = xb.abs().amax(-1) / (2 ** (bits - 1) - 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    return (q.to(torch.int8 if bits == 8 else torch.int16).reshape(m, k), d,
            d * q.sum(-1, dtype=torch.float64).float())  # exact integer sums


def quant_matmul_qa_ref(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int) -> torch.Tensor:
    """qa(x) [M, K] . dequantize(w) -> float32 [M, N]: per block (dw * d) * (integer dot) plus the
    offset term (Q4_1: mw * d * sum(q); Q4_0: -8 dw * d * sum(q)), each in float32 as the C kernel,
    summed over blocks in float64 (the C kernel sums in float32, in its own order)."""
    n, k = w.shape[0], x.shape[1]
    check_weight(w, qtype, k)
    q, d, ds = quantize_act_ref(x, bits)
    blocks = w.view(n, k // QK, BLOCK_BYTES[qtype])
    dw = _halves(blocks[..., :2])[..., 0]  # [N, nb]
    if qtype == "Q8_0":
        wq = blocks[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
        wq = torch.cat([qs & 15, qs >> 4], dim=-1).double()
    isum = torch.einsum("mbj,nbj->mnb", q.view(q.shape[0], -1, QK).double(), wq)  # exact: |sum| < 2^53
    terms = (dw[None] * d[:, None]) * isum.float()
    if qtype != "Q8_0":
        off = _halves(blocks[..., 2:4])[..., 0] if qtype == "Q4_1" else -8 * dw
        terms = terms + off[None] * ds[:, None]
    return terms.double().sum(-1).float()


def qa_cpu_library() -> ctypes.CDLL | None:
    lib = library("quant_dot_cpu.c").get()
    if lib is not None and lib.quant_matmul_qa_f32.argtypes is None:
        lib.quant_matmul_qa_f32.argtypes, lib.quant_matmul_qa_f32.restype = _QA_ARGTYPES, I32
        lib.quantize_act_f32.argtypes, lib.quantize_act_f32.restype = [I32, PTR, I64, I64, I64, PTR, PTR, PTR], I32
    return lib


def quantize_act_cpu(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The C kernel's activation quantization alone (float32 [M, K], unit stride), for tests."""
    lib = qa_cpu_library()
    if lib is None:
        return None
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8 if bits == 8 else torch.int16)
    d, ds = torch.empty(m, k // QK), torch.empty(m, k // QK)
    status = lib.quantize_act_f32(bits, x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(), ds.data_ptr())
    return (q, d, ds) if status == 0 else None


def quant_matmul_qa_cpu_unchecked(fn: Callable[..., int], x: torch.Tensor, w: torch.Tensor, qtype_id: int,
                                  bits: int) -> torch.Tensor | None:
    """csrc/quant_dot_cpu.c on float32 x [M, K] (unit stride) and contiguous w, checked by the caller."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    status = fn(bits, qtype_id, x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), m, n, k, out.data_ptr(), n)
    return out if status == 0 else None


def quant_matmul_qa_cpu(x: torch.Tensor, w: torch.Tensor, qtype: str, bits: int) -> torch.Tensor | None:
    """qa(x) . dequantize(w) by the C kernel, `bits`-bit activations; None when it does not apply."""
    if not (x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1
            and w.device.type == "cpu" and w.is_contiguous() and qtype in GGML_TYPES and bits in ACT_BITS):
        return None
    check_weight(w, qtype, x.shape[1])
    lib = qa_cpu_library()
    return None if lib is None else quant_matmul_qa_cpu_unchecked(lib.quant_matmul_qa_f32, x, w, GGML_TYPES[qtype],
                                                                  bits)


def quant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, *, one_path: bool = False) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T -> [M, N] in x's dtype: Triton on CUDA, the C kernel on CPU
    (computing in float32), the reference otherwise."""
    if use_triton(x) and x.stride(-1) == 1 and w.is_contiguous():
        return quant_matmul_triton(x, w, qtype)
    if x.device.type == "cpu" and x.dtype != torch.float32:
        out = quant_matmul_cpu(x.float(), w, qtype, one_path=one_path)
        return out.to(x.dtype) if out is not None else quant_matmul_ref(x, w, qtype)
    out = quant_matmul_cpu(x, w, qtype, one_path=one_path)
    return out if out is not None else quant_matmul_ref(x, w, qtype)
