"""How many workers `moebus up` starts when the operator does not say (`--workers auto`).

One worker with every core's torch thread loses throughput under load on a small host: whenever another process runs (the frontend, the client), one of its OpenMP threads is off
its core and the others wait at the next barrier. Two workers that share the cores by turns
(platforms/cpu/core_share.py) do not: a busy pair runs one thread each with no barrier between them, and
a lone request still gets every core. Measured side by side with vLLM's CPU build on a 2-core
Zen 4 VM (BENCHMARKS.md, "Peers side by side"; the runs: docs/benchmarks/history-peers.md). So where the host has two
cores or more and MemAvailable for two workers, auto means two workers sharing the cores;
otherwise one. An MoE gets one worker whatever the host: a batch split between two workers has each
read nearly every expert a step, twice the weight traffic of one worker's batch (Granite-shaped,
bf16, 2 cores: c=16 211 tok/s with one worker against 121 with two; BENCHMARKS.md, "An MoE of real
shape"). A worker's memory is estimated from what it will hold (worker_memory.py: the
weight elements the model's header declares, in the dtype and format its engine will run them, the
copies kept of each, the KV cache and the runtime), not from the model file's size: the weights of a
Q4 file held dense in float32 take ~16x its bytes, those of a Q8_0 MoE in bf16 ~4x.

Each sharing worker runs its bursts in steps of SHARED_BURST_STEP_TOKENS (unless the engine's
config says otherwise): a step on half the cores takes twice as long, and smaller steps let the
fleet's first tokens out at about the pace of one worker's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .worker_memory import Estimate

SHARED_WORKERS = 2
SHARED_BURST_STEP_TOKENS = 512


@dataclass(frozen=True, slots=True)
class FleetShape:
    workers: int
    share_cores: bool
    why: str


def auto_shape(cores: int, worker: Estimate | None, mem_available: int | None) -> FleetShape:
    """The shape for `--workers auto` on a host with `cores` usable cores and `mem_available`
    bytes free, for workers estimated to hold `worker` each (None: unknown, so one worker)."""
    if cores < SHARED_WORKERS:
        return FleetShape(1, False, f"{cores} core")
    if worker is None or mem_available is None:
        return FleetShape(1, False, "the model's or the host's memory size is unknown")
    if worker.moe:
        return FleetShape(1, False, "an MoE: two workers would each read nearly every expert a step "
                                    f"(one wants ~{worker.bytes / 2**30:.1f} GiB, {worker.how})")
    need = SHARED_WORKERS * worker.bytes  # the estimate's headroom is the margin (worker_memory.py)
    wants = f"two workers want ~{need / 2**30:.1f} GiB ({worker.how})"
    if mem_available < need:
        return FleetShape(1, False, f"{mem_available / 2**30:.1f} GiB available, {wants}")
    return FleetShape(SHARED_WORKERS, True, f"{cores} cores, {mem_available / 2**30:.1f} GiB available, {wants}")


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (Linux); None elsewhere."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
