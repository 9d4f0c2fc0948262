"""GGUF-quantized linear layers in 16-output panels on 16-bit integer activations, one formula for
every row count (csrc/qpanel.h has the layout and the arithmetic).

Why: the GGUF row layout suits a one-row GEMV (quant_dot.h sums each output across its lanes), but
not a batch, where its float path decodes the weights to float32 and loses to bf16 by far at 64
rows. Panels put 16 outputs in the 16 lanes of a register: a block's 32 weights are integer
multiply-adds of one broadcast activation pair each (vpdpwssd), exact in int32, then one scaled
float multiply-add a block. The same arithmetic for one row or a thousand, so a row's logits never
depend on the rest of the batch, the batch-1 decode step (decode_stack_cpu.c) gives the module
path's bits, and a 4.5-bit weight is read per multiply-add at batch 1.

Semantics: quant_matmul.quant_matmul_qa_ref at 16 bits (the reference sums its blocks in float64,
the kernel in float32 in block order: they differ by float32 rounding of the sum).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .cpu_build import I32, I64, PTR, library
from .quant_matmul import GGML_TYPES, QK, check_weight

_SOURCE = "qpanel_cpu.c"
PANEL = 16  # outputs a panel
_CODE_BYTES = {"Q4_0": 256, "Q4_1": 256, "Q8_0": 512}
_SCALE_BYTES = {"Q4_0": 32, "Q4_1": 64, "Q8_0": 32}
_MATMUL_ARGS = [I32, PTR, I64, PTR, I64, I64, I64, PTR, I64]


def panel_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of the panels of an [n, k] weight: its GGUF blocks' bytes, n padded to a multiple of 16."""
    return -(-n // PANEL) * (k // QK) * (_CODE_BYTES[qtype] + _SCALE_BYTES[qtype])


@functools.cache
def simd_available() -> bool:
    """Whether the panels run on AVX-512 here (elsewhere the kernel is plain C: right but slow)."""
    lib = library(_SOURCE).get()
    return lib is not None and bool(lib.qpanel_simd())


def pack_panels(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor | None:
    """GGUF rows uint8 [N, K / 32 * block bytes] -> the panels (uint8 [panel_bytes]), or None without
    the C library."""
    check_weight(w, qtype, k)
    fn = library(_SOURCE).entry("qpanel_pack", [I32, PTR, I64, I64, I64, PTR])
    if fn is None:
        return None
    w = w.contiguous()
    out = torch.empty(panel_bytes(qtype, w.shape[0], k), dtype=torch.uint8)
    if fn(GGML_TYPES[qtype], w.data_ptr(), w.stride(0), w.shape[0], k, out.data_ptr()) != 0:
        return None
    return out


def matmul_function(plain: bool = False) -> Callable[..., int] | None:
    """The C entry point (plain: the plain C tile, which tests compare the SIMD tile's bits with)."""
    return library(_SOURCE).entry("qpanel_matmul_plain_f32" if plain else "qpanel_matmul_f32", _MATMUL_ARGS)


def qpanel_matmul_unchecked(fn: Callable[..., int], x: torch.Tensor, panels: torch.Tensor, qtype_id: int,
                            n: int) -> torch.Tensor | None:
    """float32 x [M, K] (unit stride) on the panels of an [n, K] weight, checked by the caller."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    status = fn(qtype_id, x.data_ptr(), x.stride(0), panels.data_ptr(), m, n, k, out.data_ptr(), n)
    return out if status == 0 else None


def qpanel_matmul(x: torch.Tensor, panels: torch.Tensor, qtype: str, n: int, *, plain: bool = False
                  ) -> torch.Tensor | None:
    """x [M, K] float32 CPU on the panels of an [n, K] weight -> float32 [M, n]; None without the C
    library. plain: the kernel's plain C tile."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.shape)
    assert panels.dtype == torch.uint8 and panels.numel() == panel_bytes(qtype, n, x.shape[1]), panels.shape
    fn = matmul_function(plain)
    if fn is None:
        return None
    return qpanel_matmul_unchecked(fn, x if x.stride(1) == 1 else x.contiguous(), panels, GGML_TYPES[qtype], n)
