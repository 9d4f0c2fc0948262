"""Mixture-of-experts MLP: out[t] = sum_j w[t, j] * W2[e] @ swiglu(W13[e] @ x[t]), e = ids[t, j].

x [T, D], w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I], topk_weights [T, k], topk_ids
[T, k]. Both paths group the T*k (token, slot) assignments by expert so each expert runs one GEMM
over its tokens. GEMM outputs are rounded to x's dtype (as an unfused module would); the weighted
combine over the k slots is summed in float32.
"""
from __future__ import annotations

import functools

import torch

from ._compat import check_launchable, tl, triton, upcast_dots, use_triton
from .cpu_build import F32, I32, I64, PTR, library, on_cpu
from .lm_head_argmax import pack_panels
from .silu_mul import silu_and_mul_ref, silu_and_mul_triton

# The C kernel takes batches up to CPU_MAX_TOKENS tokens, and any batch when an expert's weights
# are at most CPU_SMALL_EXPERT_BYTES (cache-resident: the per-expert torch ops dominate the
# reference there). Larger batches of larger experts are GEMM-bound and the reference's torch
# GEMMs are as fast (measured on a Zen 3 VM in fp32: docs/benchmarks/history-engine.md, "Fused MoE
# C kernel").
CPU_MAX_TOKENS = 1024
CPU_SMALL_EXPERT_BYTES = 1 << 20
_CPU_ARGTYPES = [PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, F32]


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    t, d = x.shape
    e, two_i, d13 = w13.shape
    assert d13 == d and two_i % 2 == 0, (x.shape, w13.shape)
    assert w2.shape == (e, d, two_i // 2), (w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (topk_ids.shape, x.shape)
    assert not topk_ids.is_floating_point(), topk_ids.dtype


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    _check(x, w13, w2, topk_weights, topk_ids)
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).to(torch.long)
    order = torch.argsort(flat_ids, stable=True)  # assignment indices grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token = order // k
    y = x.new_empty(t * k, x.shape[1])  # per assignment, in expert-sorted order
    start = 0
    for e, n in enumerate(counts):  # one pair of GEMMs per expert that has tokens
        if n == 0:
            continue
        h = silu_and_mul_ref(x[token[start:start + n]] @ w13[e].t(), limit=swiglu_limit)
        torch.matmul(h, w2[e].t(), out=y[start:start + n])
        start += n
    # Unsort with a gather (index_add_ scatters row by row on CPU), then combine the k slots.
    y = y[torch.argsort(order)].view(t, k, x.shape[1]).float()
    return torch.einsum("tk,tkd->td", topk_weights.float(), y).to(x.dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k assignments by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_ids [P] int32 (assignment index t*k+j, or T*k for padding), expert_ids
    [P / block_m] int32 (-1 for blocks past the last expert) and num_padded [1] int32. P is a
    host-side upper bound, so this does no device->host sync.
    """
    flat = topk_ids.reshape(-1).to(torch.long)
    n = flat.numel()
    dev = flat.device
    max_padded = n + min(num_experts, n) * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(n, device=dev) - start[e_sorted]  # position inside the expert's run
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids[padded_start[e_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_valid, a_row_div,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # C[id] = A[id // a_row_div] @ B[e].T for the BLOCK_M assignment ids of one expert block.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:  # the grid is sized for the worst case
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_padded, other=num_valid)
    m_mask = ids < num_valid  # padding slots hold num_valid
    rows = (ids // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (offs_k + k0) < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + ids, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, align: tuple[torch.Tensor, ...],
                  a_row_div: int, weights: torch.Tensor | None, block_m: int, block_n: int,
                  block_k: int) -> None:
    sorted_ids, expert_ids, num_padded = align
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1, "inner dims must be contiguous"
    n, k = b.shape[1], b.shape[2]
    assert a.shape[1] == k and c.shape[1] == n, (a.shape, b.shape, c.shape)
    _grouped_gemm_kernel[(expert_ids.numel(), triton.cdiv(n, block_n))](
        a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, num_padded,
        n, k, c.shape[0], a_row_div, a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_WEIGHT=weights is not None,
        UPCAST=upcast_dots(a.dtype, b.dtype),
        PRECISION="ieee" if a.dtype == torch.float32 else None,  # exact fp32, like torch's default
    )


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, swiglu_limit: float | None = None, *,
                     block_m: int | None = None, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    _check(x, w13, w2, topk_weights, topk_ids)
    check_launchable(x, w13, w2, topk_weights, topk_ids)
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    t, k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    if block_m is None:  # small decode batches: few tokens per expert, so small M tiles
        block_m = 16 if t * k <= 4 * num_experts else 64
    align = moe_align(topk_ids, num_experts, block_m)
    h = torch.empty(t * k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, align, k, None, block_m, block_n, block_k)
    act = silu_and_mul_triton(h, limit=swiglu_limit)
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, y, align, 1, weights, block_m, block_n, block_k)
    return y.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, swiglu_limit: float | None = None,
                  max_tokens: int | None = CPU_MAX_TOKENS) -> torch.Tensor | None:
    """The C kernel in csrc/fused_moe_cpu.c; None when it does not apply (more than max_tokens
    tokens of experts above CPU_SMALL_EXPERT_BYTES). Each token's result is computed on its own, so
    it is batch-invariant at any size."""
    _check(x, w13, w2, topk_weights, topk_ids)
    t, k = topk_ids.shape
    expert_bytes = (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]) * w13.element_size()
    if t == 0 or (max_tokens is not None and t > max_tokens and expert_bytes > CPU_SMALL_EXPERT_BYTES):
        return None
    if not (x.dim() == 2 and on_cpu(x, w13, w2)
            and w13.is_contiguous() and w2.is_contiguous() and topk_ids.device.type == "cpu"):
        return None
    fn = library("fused_moe_cpu.c").function("fused_moe", x.dtype, _CPU_ARGTYPES)
    if fn is None:
        return None
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    e, two_i, d = w13.shape
    status = fn(x.data_ptr(), x.stride(0), w13.data_ptr(), w2.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                out.data_ptr(), t, k, e, d, two_i // 2, swiglu_limit is not None,
                0.0 if swiglu_limit is None else float(swiglu_limit))
    return out if status == 0 else None


def pack_expert_panels(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> each expert's pack_panels layout, experts back to back (a copy)."""
    return torch.stack([pack_panels(w[e]) for e in range(w.shape[0])])


@functools.cache
def _panels_supported(dtype: torch.dtype) -> bool:
    """Whether this build and CPU run csrc/fused_moe_panels_cpu.c for `dtype` (one tiny probe call)."""
    x, w13, w2 = torch.ones(1, 32, dtype=dtype), torch.zeros(1, 64, 32, dtype=dtype), torch.zeros(1, 32, 32, dtype=dtype)
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    return fused_moe_panels_cpu(x, ExpertPanels.pack(w13, w2), weights, ids, 32) is not None


class ExpertPanels:
    """The packed copy of one MoE layer's expert weights that the panel kernel reads, made on first
    use and again whenever the weights change (an EPLB move writes into them: their version moves).
    It doubles the experts' memory; a layer whose dtype, shapes or CPU the kernel does not take
    keeps none."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_expert_panels(w13), pack_expert_panels(w2)

    def get(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        d, i = w2.shape[1], w2.shape[2]
        if not (on_cpu(w13, w2) and w13.dtype in PANEL_DTYPES and panel_shapes_ok(d, i, w13.dtype)
                and _panels_supported(w13.dtype)):
            return None
        key = (w13.data_ptr(), w13._version, w2.data_ptr(), w2._version, w13.dtype, w13.shape[0])
        if key != self._key:
            self._packed, self._key = self.pack(w13, w2), key
        return self._packed


PANEL_DTYPES = (torch.bfloat16, torch.float32)
_PANEL_ARGTYPES = [PTR, I64, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, F32]


def panel_shapes_ok(d: int, i: int, dtype: torch.dtype) -> bool:
    """The panel kernel's shapes: 16-column panels (bf16: k in 32s, unpadded)."""
    return d % 16 == 0 and (2 * i) % 16 == 0 and (dtype != torch.bfloat16 or (d % 32 == 0 and i % 32 == 0))


def fused_moe_panels_cpu(x: torch.Tensor, panels: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, intermediate: int,
                         swiglu_limit: float | None = None) -> torch.Tensor | None:
    """csrc/fused_moe_panels_cpu.c on ExpertPanels' packed weights; None when it does not apply."""
    p13, p2 = panels
    t, k = topk_ids.shape
    if not (x.dim() == 2 and t > 0 and on_cpu(x, p13, p2) and topk_ids.device.type == "cpu"):
        return None
    fn = library("fused_moe_panels_cpu.c").function("fused_moe_panels", x.dtype, _PANEL_ARGTYPES)
    if fn is None:
        return None
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    status = fn(x.data_ptr(), x.stride(0), p13.data_ptr(), p2.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                out.data_ptr(), t, k, p13.shape[0], x.shape[1], intermediate, swiglu_limit is not None,
                0.0 if swiglu_limit is None else float(swiglu_limit))
    return out if status == 0 else None


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, swiglu_limit: float | None = None, *,
              batch_invariant: bool = False, panels: ExpertPanels | None = None) -> torch.Tensor:
    """batch_invariant: on CPU, a batch-invariant C kernel at every batch size (deterministic mode).
    panels: the layer's ExpertPanels; on CPU where the panel kernel runs, it takes every call
    (each expert's tokens in one GEMM; batch invariant too)."""
    if use_triton(x):
        return fused_moe_triton(x.contiguous(), w13, w2, topk_weights, topk_ids, swiglu_limit)
    if panels is not None and (packed := panels.get(w13, w2)) is not None:
        out = fused_moe_panels_cpu(x, packed, topk_weights, topk_ids, w2.shape[2], swiglu_limit)
        if out is not None:
            return out
    out = fused_moe_cpu(x, w13, w2, topk_weights, topk_ids, swiglu_limit,
                        max_tokens=None if batch_invariant else CPU_MAX_TOKENS)
    return out if out is not None else fused_moe_ref(x, w13, w2, topk_weights, topk_ids, swiglu_limit)
