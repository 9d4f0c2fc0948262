"""Fixed glibc malloc thresholds for the engine's transient tensors on CPU.

torch's CPU tensors come from malloc. A prefill step makes and frees activations of several MB per
layer (1536 tokens x 3072 x 2 bytes = 9.4 MB for gate/up in bf16). glibc by default serves blocks
above its mmap threshold (128 KiB at start, raised on the fly to the largest block freed, at most
32 MiB) with fresh mmaps, and hands the heap's top back to the kernel past its trim threshold
(twice that), so the next step page-faults its activations in again: zeroed 4 KiB pages, on every
thread of the step, and a step's time varies from one process to the next (SmolLM2 bf16 prefill
steps: docs/benchmarks/history-peers.md, "Prefill step: glibc malloc").

Fixed thresholds keep freed blocks in the heap for reuse (mallopt also stops glibc's own
adjustment): the process keeps its high-water mark of activations instead of returning it. Linux
with glibc only (mallopt is not POSIX); elsewhere nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
import platform
from dataclasses import dataclass

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


@dataclass(frozen=True)
class MallocTuning:
    mmap_threshold: int = 32 << 20  # glibc's largest allowed (64-bit): blocks above it stay mmaps
    trim_threshold: int = 1 << 30  # give the heap's top back only past this much free
    top_pad: int = 64 << 20  # grow the heap by this much extra at a time: fewer brk calls


def tune_malloc(t: MallocTuning = MallocTuning()) -> bool:
    """Apply `t` to this process's glibc malloc; False (nothing changed) without glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, t.mmap_threshold), (M_TRIM_THRESHOLD, t.trim_threshold), (M_TOP_PAD, t.top_pad)))
    log.info("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB, top pad %d MiB%s", t.mmap_threshold >> 20,
             t.trim_threshold >> 20, t.top_pad >> 20, "" if done else " (refused in part)")
    return done
