"""Linear layers on CPU: oneDNN-prepacked weights (fp32 and bf16). (The GGUF-quantized layer,
QuantLinear, is engine/quant_linear.py.)

`F.linear` on the plain [out, in] weight re-lays the weight out on every call (bf16) or goes to
MKL's sgemm (fp32); oneDNN's matmul on a weight reordered once into its blocked layout is faster:
bf16 at decode sizes 1.2-1.7x (AVX-512/AMX; at 4096 rows the plain path wins, 0.7x), fp32 at
every row count on AVX2 (Zen 3: 1.1-1.2x on the layer shapes of SmolLM2, 1.3-2.2x on its
49152-row LM head, 1-4096 rows). A PackedLinear keeps both weights and picks by dtype and row
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
# size there (2 threads, SmolLM2's four layer shapes, weights packed for 64 rows). Sapphire Rapids
# (AMX): 1536 rows 4.16 vs 4.45 ms, 2048 5.56 vs 5.65, 4096 11.27 vs 11.40, a 1536-token prefill step
# 289-301 vs 304-325 ms (512 rows alone lose, 1.94 vs 1.79). Zen 4 (avx512_bf16, no AMX;
# loadtest/ab_packed_linear.py, medians of 9): 256 rows 4.61 vs 5.19 ms, 512 8.98 vs 9.77, 1536 25.96
# vs 28.54, 2048 34.61 vs 37.61. The cap of 256 stays for CPUs that only convert bf16 (unmeasured
# since it was set).
PACKED_MAX_ROWS: dict[torch.dtype, int | None] = {torch.bfloat16: 256, torch.float32: None}
PACKED_MAX_ROWS_NATIVE_BF16: dict[torch.dtype, int | None] = {torch.bfloat16: None, torch.float32: None}

# Where the CPU has AVX-512 but no AMX (panels_wanted), every call takes kernels/panel_linear.py
# (pack_panels' layout, the next weights prefetched): bf16 on vdpbf16ps, float32 on AVX-512 FMAs.
# Its rows are summed in one order whatever the call holds, so a row's result never depends on the
# rest of the step: greedy tokens are the same alone or batched, by default (oneDNN picks its
# blocking by row count). At decode sizes it is also the faster kernel. Zen 4 VM, 2 threads,
# SmolLM2's four layer shapes x 30 layers of distinct weights (cold, as in a decode step),
# loadtest/ab_panel_linear.py --head, oneDNN's packed GEMM -> the panel kernel, 7/7 rounds each:
# bf16 1 row 13.7 -> 9.8 ms, 16 rows 18.9 -> 14.5, 64 49.8 -> 45.3, 128 89.6 -> 85.5; float32
# (layers only) 1 row 17.8 -> 11.9, 16 rows 24.5 -> 20.2, 64 77.3 -> 68.9, 128 148.0 -> 141.3.
# Above that it is what batch invariance costs (bf16, ab_panel_linear.py --rows 256 512 1024 1536
# --rounds 5): 0.98x-1.02x oneDNN's speed up to 512 rows, 0.94x at 1536; a burst of 128-token
# prompts, in process (ab_batch_invariance.py): -1% to -3% tok/s (BENCHMARKS.md, issue 34).

# Calls of fewer multiply-adds (rows x in x out) take the plain GEMM: oneDNN's packed call costs
# ~40 us more per call, which small GEMMs never win back. Measured on a Zen 3 VM in fp32 (packed vs
# F.linear): 64 x 128 -> 128 82 vs 29 us, 1 x 1536 -> 576 132 vs 80 us, 64 x 128 -> 512 (4.2M)
# 101 vs 131 us, 64 x 576 -> 1536 865 vs 966 us. bf16 is unmeasured there (no AVX-512): 0.
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
    embedding (the vocab GEMM is the largest of a decode step: 1.6-1.9x faster packed at 64 rows).
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
        # Measured on a Zen 3 VM: a 64 x 576 x 3072 bf16 GEMM 12.1 ms vs 2.4 ms in float32.
        log.warning("bf16 weights cannot be prepacked on this CPU (no AVX-512 / AVX-NE-CONVERT) and torch's "
                    "bf16 GEMMs here run ~4-5x slower than float32: serve with dtype float32")
    emb = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(emb, nn.Embedding) and _packable(emb.weight):
        model.lm_head = _packed(emb.weight, None, row_hint)
        n += 1
    return n
