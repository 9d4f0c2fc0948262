"""The CPU's SIMD flags, as /proc/cpuinfo names them: what the dtype, format and kernel choices read."""
from __future__ import annotations

from collections.abc import Iterable

SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
               "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def shown_flags(flags: Iterable[str]) -> list[str]:
    """The SIMD flags that matter for these kernels, in a fixed order (for logs and benchmark tables)."""
    have = set(flags)
    return [f for f in SHOWN_FLAGS if f in have]
