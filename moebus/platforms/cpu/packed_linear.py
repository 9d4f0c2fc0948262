"""Linear layers on CPU: oneDNN-prepacked weights (fp32 and bf16). (The GGUF-quantized layer,
QuantLinear, is engine/quant_linear.py.)

`F.linear` on the plain [out, in] weight re-lays the weight out on every call (bf16) or goes to
MKL's sgemm (fp32); oneDNN's matmul on a weight reordered once into its blocked layout is faster
for bf16 at decode sizes and for fp32 at every row count on AVX2 (the SmolLM2 layer shapes and
its 49152-row LM head; figures in docs/benchmarks/history-engine.md). A PackedLinear keeps both weights and picks by dtype and row
count. Results are the same GEMM up to summation order (tested against F.linear). The packed copy
is taken once: weights must not change after, and it doubles the memory of the packed weights. On
AVX-512 CPUs without AMX, layers keep a third copy in pack_panels' layout, and kernels/panel_linear.py
takes every call there (a row's result independent of the batch; faster at decode sizes).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.panel_linear import PanelLinear, panel_linear_applies
from moebus.platforms.cpu.flags import cpu_flags

log = logging.getLogger(__name__)

# Rows above which the plain GEMM is used; None: packed at every size. Where the CPU has native bf16
# dot products the packed bf16 GEMM is as fast or faster at large sizes too, so it is packed at every
# size there: measured so on Sapphire Rapids (AMX) and Zen 4 (avx512_bf16, no AMX;
# loadtest/ab_packed_linear.py; figures in docs/benchmarks/history-peers.md). The cap of 256 stays
# for CPUs that only convert bf16 (unmeasured since it was set).
PACKED_MAX_ROWS: dict[torch.dtype, int | None] = {torch.bfloat16: 256, torch.float32: None}
PACKED_MAX_ROWS_NATIVE_BF16: dict[torch.dtype, int | None] = {torch.bfloat16: None, torch.float32: None}

# Where the CPU has AVX-512 but no AMX (panels_wanted), every call takes kernels/panel_linear.py
# (pack_panels' layout, the next weights prefetched): bf16 on vdpbf16ps, float32 on AVX-512 FMAs.
# Its rows are summed in one order whatever the call holds, so a row's result never depends on the
# rest of the step: greedy tokens are the same alone or batched, by default (oneDNN picks its
# blocking by row count). At decode sizes it is also the faster kernel (its weights prefetched
# while the last are summed; loadtest/ab_panel_linear.py). At prefill sizes oneDNN is a little
# faster, which is what batch invariance costs (BENCHMARKS.md, "Engine decode throughput at batch
# 16/64" and issue 34).

# Calls of fewer multiply-adds (rows x in x out) take the plain GEMM: oneDNN's packed call has a
# fixed cost per call that small GEMMs never win back (fp32 on a Zen 3 VM; docs/benchmarks/
# history-engine.md, "Plain GEMM under 4M multiply-adds"). bf16 is unmeasured there (no AVX-512): 0.
PACKED_MIN_MACS: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float32: 1 << 22}


@functools.cache
def packed_max_rows(dtype: torch.dtype) -> int | None:
    """PACKED_MAX_ROWS for this CPU."""
    native = {"amx_bf16", "avx512_bf16"} & cpu_flags()
    return (PACKED_MAX_ROWS_NATIVE_BF16 if native else PACKED_MAX_ROWS)[dtype]


@functools.cache
def panels_wanted(dtype: torch.dtype) -> bool:
    """Whether PackedLinear keeps a pack_panels copy for the panel kernel (then it takes every call)."""
    flags = cpu_flags()
    needs = {torch.bfloat16: "avx512_bf16", torch.float32: "avx512f"}.get(dtype)
    return needs in flags and "amx_bf16" not in flags


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether oneDNN can prepack `dtype` weights on this CPU. bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only CPU raises at reorder time), so probe once with a tiny weight."""
    if dtype not in PACKED_MAX_ROWS:
        return False
    if not (hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Linear):
    packed: torch.Tensor
    panels: torch.Tensor | None  # pack_panels(weight) where panels_wanted: the panel kernel takes every call
    panel: PanelLinear | None  # the kernel bound to panels
    max_rows: int | None
    min_rows: int  # fewest rows worth the packed call (PACKED_MIN_MACS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        panel = self.__dict__["panel"]  # a plain attribute: not through nn.Module's __getattr__
        if panel is not None:
            out = panel(flat)
            if out is not None:
                return out.reshape(*x.shape[:-1], out.shape[-1])
        if (rows < self.min_rows or (self.max_rows is not None and rows > self.max_rows)
                or flat.dtype != self.weight.dtype):
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _packed(weight: nn.Parameter, bias: nn.Parameter | None, row_hint: int) -> PackedLinear:
    new = PackedLinear.__new__(PackedLinear)
    nn.Module.__init__(new)
    new.out_features, new.in_features = weight.shape
    new.weight, new.bias = weight, bias
    new.max_rows = packed_max_rows(weight.dtype)
    new.min_rows = -(-PACKED_MIN_MACS[weight.dtype] // weight.numel())
    new.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), row_hint),
                        persistent=False)
    n, k = weight.shape
    panels = pack_panels(weight) if panels_wanted(weight.dtype) and panel_linear_applies(n, k, weight.dtype) else None
    new.register_buffer("panels", panels, persistent=False)
    new.panel = None if panels is None else PanelLinear(panels, n, k, bias)
    return new


def _packable(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and packing_available(w.dtype)


def pack_linears(model: nn.Module, row_hint: int = 64) -> int:
    """Swap every fp32/bf16 CPU nn.Linear for a PackedLinear sharing its parameters, and give a
    model whose LM head is tied to `embed_tokens` (lm_head None) a packed head sharing the
    embedding (the vocab GEMM is the largest of a decode step, and faster packed).
    Returns how many were packed."""
    n = 0
    unpacked_bf16 = False
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _packable(child.weight):
                setattr(parent, name, _packed(child.weight, child.bias, row_hint))
                n += 1
            elif type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                unpacked_bf16 = True
    if unpacked_bf16:
        # Without native bf16 arithmetic torch's bf16 GEMM is several times slower than float32 (Zen 3
        # VM: docs/benchmarks/history-engine.md, "Stop 10").
        log.warning("bf16 weights cannot be prepacked on this CPU (no AVX-512 / AVX-NE-CONVERT) and torch's "
                    "bf16 GEMMs here run ~4-5x slower than float32: serve with dtype float32")
    emb = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(emb, nn.Embedding) and _packable(emb.weight):
        model.lm_head = _packed(emb.weight, None, row_hint)
        n += 1
    return n
