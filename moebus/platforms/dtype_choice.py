"""The compute dtype for `dtype="auto"`: chosen from the CPU's flags (platforms/cpu/flags.py), as vLLM's
CPU build does.

bf16 pays off on a CPU only with native bf16 dot products (AVX512-BF16's VDPBF16PS or AMX's tile
ops); without them oneDNN/torch emulate bf16 through fp32 conversions and it is slower than fp32
(AVX2-only Zen 3: fp32). So: bfloat16 where the CPU has avx512_bf16 or amx_bf16, float32
otherwise. Accelerators: bfloat16 where the device supports it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from moebus.platforms.cpu.flags import cpu_flags, shown_flags

log = logging.getLogger(__name__)

EXPLICIT = ("float32", "bfloat16", "float16")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 dot products


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # one of EXPLICIT
    reason: str  # why, for the log


def choose_dtype(requested: str, device: str = "cpu", flags: Iterable[str] | None = None,
                 accel_bf16: bool | None = None) -> DtypeChoice:
    """Resolve `requested` ("auto" or an explicit dtype). `flags`: the CPU's (default: read them);
    `accel_bf16`: whether a non-CPU device supports bf16 (default: ask torch)."""
    if requested in EXPLICIT:
        return DtypeChoice(requested, "asked for")
    if requested != "auto":
        raise ValueError(f"dtype must be auto or one of {list(EXPLICIT)}, not {requested!r}")
    if not device.startswith("cpu"):
        if accel_bf16 is None:
            import torch

            accel_bf16 = bool(device.startswith("cuda") and torch.cuda.is_available()
                              and torch.cuda.is_bf16_supported())
        return (DtypeChoice("bfloat16", f"auto: {device} supports bf16") if accel_bf16
                else DtypeChoice("float32", f"auto: no bf16 on {device}"))
    have = set(cpu_flags() if flags is None else flags)
    native = [f for f in BF16_FLAGS if f in have]
    if native:
        return DtypeChoice("bfloat16", f"auto: the CPU has {'+'.join(native)}")
    return DtypeChoice("float32", f"auto: the CPU has no native bf16 (no {' or '.join(BF16_FLAGS)}; "
                                  f"SIMD: {' '.join(shown_flags(have)) or 'none listed'})")


def resolve_dtype(requested: str, device: str = "cpu", flags: Iterable[str] | None = None) -> str:
    """choose_dtype, logged once at engine start."""
    choice = choose_dtype(requested, device, flags)
    log.info("compute dtype %s (%s)", choice.dtype, choice.reason)
    return choice.dtype
