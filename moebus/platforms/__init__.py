"""Device- and CPU-specific choices behind one seam: `current(device)` is the Platform (interface.py)
that the engine, the models and the worker ask, never `device.type == "cpu"` tests of their own.

- cpu/: CpuPlatform (cpu/platform.py) and what it chooses among: prepacked oneDNN linears
  (packed_linear.py), the batch-1 decode C step (decode_fast_path.py, moe_decode.py), the panel
  LM head (lm_head.py), malloc thresholds (malloc.py), the CPU's flags (flags.py), and the host's
  cores: how many (cores.py) and how co-located workers share them (platforms/cpu/core_share.py).
- cuda.py: CudaPlatform, every other device (the Triton and torch paths).
- dtype_choice.py, format_choice.py: `dtype="auto"` / `weight_format="auto"` for a device.

Kernels stay in moebus/kernels (torch and triton only); a platform picks among them. This package,
cpu/flags.py, cpu/cores.py and cpu/core_share.py import no torch: torch-free services read them.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from moebus.platforms.interface import Platform

if TYPE_CHECKING:
    import torch

__all__ = ["Platform", "current", "of"]


def current(device: str | torch.device) -> Platform:
    """The platform of `device` ("cpu", "cuda:0", a torch.device): CpuPlatform on the CPU, else
    CudaPlatform."""
    return _platform(str(device))


def of(tensor: torch.Tensor) -> Platform:
    """The platform of the device `tensor` lives on, for per-call kernel choices (by device type:
    one attribute read and a cached lookup)."""
    return _platform(tensor.device.type)


@functools.cache
def _platform(device: str) -> Platform:
    if device.partition(":")[0] == "cpu":
        from moebus.platforms.cpu.platform import CpuPlatform

        return CpuPlatform(device)
    from moebus.platforms.cuda import CudaPlatform

    return CudaPlatform(device)
