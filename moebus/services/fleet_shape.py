"""How many workers `moebus up` starts when the operator does not say (`--workers auto`).

One worker with every core's torch thread loses throughput under load on a small host: whenever another process runs (the frontend, the client), one of its OpenMP threads is off
its core and the others wait at the next barrier. Two workers that share the cores by turns
(platforms/cpu/core_share.py) do not: a busy pair runs one thread each with no barrier between them, and
a lone request still gets every core. Measured side by side with vLLM's CPU build on a 2-core
Zen 4 VM (BENCHMARKS.md, "Peers side by side"; the runs: docs/benchmarks/history-peers.md). So where the host has two
cores or more and memory for two copies of the model, auto means two workers sharing the cores;
otherwise one.

Each sharing worker runs its bursts in steps of SHARED_BURST_STEP_TOKENS (unless the engine's
config says otherwise): a step on half the cores takes twice as long, and smaller steps let the
fleet's first tokens out at about the pace of one worker's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHARED_WORKERS = 2
SHARED_BURST_STEP_TOKENS = 512
# A worker's resident bytes per byte of model files: the weights dequantized to float32 (a Q4 GGUF
# is ~4.5 bits a weight) and held up to three times (the weight, oneDNN's packed copy, the decode
# kernel's panels). SmolLM2-135M Q4_1: 98 MB file, 3.3 GB float32 worker with its 1 GiB KV cache.
BYTES_PER_FILE_BYTE = 24
RUNTIME_BYTES = 1 << 30  # torch, Python and the heap beside the weights and the KV cache
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True, slots=True)
class FleetShape:
    workers: int
    share_cores: bool
    why: str


def auto_shape(cores: int, model_bytes: int | None, kv_cache_bytes: int, mem_available: int | None) -> FleetShape:
    """The shape for `--workers auto` on a host with `cores` usable cores and `mem_available`
    bytes free, for a model of `model_bytes` on disk (None: unknown, so one worker)."""
    if cores < SHARED_WORKERS:
        return FleetShape(1, False, f"{cores} core")
    if model_bytes is None or mem_available is None:
        return FleetShape(1, False, "the model's or the host's memory size is unknown")
    per_worker = model_bytes * BYTES_PER_FILE_BYTE + kv_cache_bytes + RUNTIME_BYTES
    need = SHARED_WORKERS * per_worker  # the estimate is the headroom (SmolLM2: 4.5 GB, 3.3 measured)
    if mem_available < need:
        return FleetShape(1, False, f"{mem_available / 2**30:.1f} GiB available, two workers want "
                                    f"~{need / 2**30:.1f}")
    return FleetShape(SHARED_WORKERS, True, f"{cores} cores, {mem_available / 2**30:.1f} GiB available")


def model_file_bytes(path: Path) -> int | None:
    """The bytes of a model's weight files: a file's size, or a checkpoint directory's weight files."""
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            total = sum(p.stat().st_size for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
            return total or None
    except OSError:
        return None
    return None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (Linux); None elsewhere."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
