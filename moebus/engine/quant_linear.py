"""A linear layer on GGUF weight-only quantized blocks (QuantLinear), on every device: CPU calls
take the C kernels (kernels/quant_matmul.py, quant_argmax.py, qpanel.py), others
kernels/quant_matmul.py's launcher."""
from __future__ import annotations

import torch
from torch import nn

from moebus.kernels.argmax import row_argmax
from moebus.kernels.qpanel import matmul_function as qpanel_function
from moebus.kernels.qpanel import pack_panels as pack_qpanels
from moebus.kernels.qpanel import qpanel_matmul_unchecked
from moebus.kernels.qpanel import simd_available as qpanel_simd
from moebus.kernels.quant_argmax import cpu_function as argmax_function
from moebus.kernels.quant_argmax import quant_argmax_cpu_unchecked
from moebus.kernels.quant_matmul import (
    GGML_TYPES,
    check_weight,
    cpu_function,
    qa_cpu_library,
    quant_matmul,
    quant_matmul_cpu_unchecked,
    quant_matmul_qa_cpu_unchecked,
)

# QuantLinear calls of at most this many rows take the integer-activation kernel (below the C
# kernel's tiled path, where decoding a block once for many rows is already cheap per row).
QA_MAX_ROWS = 3
# Weight types that take 16-bit activations. Q8_0 too since 2026-12-04: faster than the float path
# for SmolLM2's tied Q8_0 head on AVX-512 (a small loss on AVX2); the head's logits move by <= 1e-4
# (docs/benchmarks/history-engine.md, "Single-stream decode on the GGUF's blocks").
QA16_TYPES = ("Q4_0", "Q4_1", "Q8_0")


class QuantLinear(nn.Module):
    """A bias-free linear layer on GGUF weight-only quantized blocks (kernels/quant_matmul.py): the
    weight stays quantized in memory and is dequantized inside the GEMV/GEMM, so a decode step
    reads 4.5-8.5 bits per weight instead of 32. Output in x's dtype, computed in float32.

    activation_bits: calls of at most QA_MAX_ROWS rows (decode steps) quantize x to 16-bit (or, as
    llama.cpp, 8-bit) blocks and take integer dot products per weight block (csrc/quant_dot_cpu.c,
    faster a block than decoding it to floats); logits then differ from the dequantized model by
    the activation's rounding (BENCHMARKS.md: 16 bits kept greedy output identical on the parity
    prompts, 8 bits did not). None: float32 activations everywhere.

    Where AVX-512 runs kernels/qpanel.py, 16-bit activations take its panels (a copy of the weight
    laid out 16 outputs a register) at every row count: one formula, so a row's result never
    depends on the batch, and batches run on integer dot products near bf16's speed."""

    batch_invariant = False  # make_batch_invariant sets it: then every row count takes one kernel path

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int, *,
                 activation_bits: int | None = 16) -> None:
        super().__init__()
        check_weight(qweight, qtype, in_features)
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", qweight.contiguous())
        assert activation_bits in (None, 8, 16), activation_bits
        self.activation_bits = activation_bits
        self._cpu_fn = cpu_function()  # checked here once, so float32 CPU calls go straight to C
        lib = qa_cpu_library()
        self._qa_fn = lib.quant_matmul_qa_f32 if lib is not None else None
        self._argmax_fn = argmax_function()
        self._qtype_id = GGML_TYPES[qtype]
        self._qa16 = qtype in QA16_TYPES
        self._panel_fn = qpanel_function() if self._qa16 and qpanel_simd() and not qweight.is_cuda else None
        panels = pack_qpanels(self.qweight, qtype, in_features) if self._panel_fn is not None else None
        self.register_buffer("panels", panels, persistent=False)  # None where they do not apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 2-D x (the models' [tokens, hidden]) skips both reshapes: a large share of a 1-row call's
        # Python, and a decode step makes ~120 of these calls.
        two_d = x.dim() == 2 and x.shape[1] == self.in_features
        flat = x if two_d else x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        w = self.qweight
        out = None
        if self.uses_panels() and not flat.is_cuda:
            out = qpanel_matmul_unchecked(self._panel_fn, flat.float(), self.panels, self._qtype_id,
                                          self.out_features)
            if out is not None:
                return out.to(x.dtype) if two_d else out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if flat.dtype == torch.float32 and not flat.is_cuda and not w.is_cuda:
            # batch-invariant mode keeps one float path for every row count
            bits = self.few_rows_activation_bits() if flat.shape[0] <= QA_MAX_ROWS else None
            if bits:
                out = quant_matmul_qa_cpu_unchecked(self._qa_fn, flat, w, self._qtype_id, bits)
            elif self._cpu_fn is not None:
                out = quant_matmul_cpu_unchecked(self._cpu_fn, flat, w, self._qtype_id, self.batch_invariant)
        if out is None:
            out = quant_matmul(flat, w, self.qtype, one_path=self.batch_invariant)
        return out if two_d else out.reshape(*x.shape[:-1], self.out_features)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [M]: the first maximum (or first NaN) of each row of the float32 logits self(x.float())
        for x [M, in_features]. A float32 CPU call of at most QA_MAX_ROWS rows (a batch-1 decode step's LM head)
        takes csrc/quant_argmax_cpu.c: the same logits, never written out."""
        if self.uses_panels():
            return row_argmax(self(x.float()))  # the panels' logits, as every other row count's
        if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= QA_MAX_ROWS and x.stride(1) == 1
                and self._argmax_fn is not None and not x.is_cuda and not self.qweight.is_cuda):
            bits = self.few_rows_activation_bits()
            if bits or self._cpu_fn is not None:  # as forward: else float activations on the direct path
                out = quant_argmax_cpu_unchecked(self._argmax_fn, x, self.qweight, self._qtype_id, bits)
                if out is not None:
                    return out
        return row_argmax(self(x.float()))  # float32 logits, whatever x's dtype

    def uses_panels(self) -> bool:
        """Whether CPU calls take the panels (then the batch-1 decode step reads them too)."""
        return self.activation_bits == 16 and self.panels is not None and not self.panels.is_cuda

    def few_rows_activation_bits(self) -> int | None:
        """The integer activation width a float32 CPU call of at most QA_MAX_ROWS rows takes, or None
        for float activations (the batch-1 decode step of platforms/cpu/decode_fast_path.py asks too)."""
        bits = self.activation_bits
        ok = bits and (bits == 8 or self._qa16) and self._qa_fn is not None and not self.batch_invariant
        return bits if ok else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"activation_bits={self.activation_bits}")
