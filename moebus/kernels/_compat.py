"""Optional Triton: kernel modules import `triton` and `tl` from here so they import without it.

Without triton the `@triton.jit` kernels stay plain Python functions that are never launched
(dispatchers then always take the torch reference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install
    HAS_TRITON = False

    class _TritonStub:
        @staticmethod
        def jit(fn: Callable | None = None, **_kwargs: object) -> Callable:
            return fn if fn is not None else (lambda f: f)

    class _LanguageStub:
        constexpr = object  # only evaluated as a parameter annotation

    triton = _TritonStub()  # type: ignore[assignment]
    tl = _LanguageStub()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "triton", "tl", "use_triton", "check_launchable", "upcast_dots", "next_pow2"]


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through triton's numpy interpreter."""
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)


def use_triton(x: torch.Tensor) -> bool:
    """The dispatch rule shared by every op: Triton for CUDA tensors, torch reference otherwise."""
    return HAS_TRITON and x.is_cuda


def check_launchable(*tensors: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_ref implementation")
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    assert tensors[0].is_cuda or interpreting(), "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)"


def upcast_dots(*dtypes: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot float32 operands instead of bfloat16 ones.

    triton 3.9's interpreter multiplies bfloat16 tl.dot operands as their raw uint16 bits, so
    under TRITON_INTERPRET we upcast (exact: a bf16*bf16 product fits in fp32, as on the GPU).
    """
    return interpreting() and torch.bfloat16 in dtypes


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
