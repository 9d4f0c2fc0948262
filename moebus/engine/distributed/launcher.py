"""Start an EP group: N processes, one `DPEngine` each, joined over torch.distributed.

`launch_ep_group(model, ep_size, rank_main, ...)` starts the ranks (torch.multiprocessing,
rendezvous on a free TCP port), builds a `DPEngine` per rank and calls
`rank_main(engine, *args)` there; it returns the ranks' results in rank order, or with
`wait=False` an `EPGroupHandle` to `join()` later. `rank_main` must be a top-level (picklable)
function; it owns the rank's serving loop and must call `engine.step()` in lockstep with the
other ranks. If a rank fails, the others are stopped and the failure is raised here.
`rank_setup(rank)` runs first in each rank process, before torch threads or sockets exist: e.g. to
enter a per-rank network namespace (loadtest/bench_ep_hosts.py puts the ranks on two "hosts").
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.group import destroy_ep_group, init_ep_group, resolve_backend
from moebus.shared.ports import free_port


@dataclass(slots=True)
class RankSpec:
    """Everything a rank process needs to build its engine (pickled to the child)."""

    model: str
    ep_size: int
    init_method: str
    backend: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    ep: EPConfig = field(default_factory=EPConfig)
    torch_threads: int | None = 1
    rank_setup: Callable[[int], None] | None = None  # picklable; called with the rank in its process


def _rank_entry(rank: int, spec: RankSpec, rank_main: Callable[..., Any], args: tuple, out: mp.Queue) -> None:
    if spec.rank_setup is not None:
        try:
            spec.rank_setup(rank)
        except BaseException:
            out.put((rank, False, traceback.format_exc()))
            return
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        group = init_ep_group(spec.ep_size, rank, spec.backend, spec.init_method)
        engine = DPEngine(EngineConfig(model=spec.model, device=str(group.device), **spec.engine_kwargs),
                          group, spec.ep)
        result = rank_main(engine, *args)
        engine.close()
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        destroy_ep_group()


@dataclass(slots=True)
class EPGroupHandle:
    processes: list[mp.process.BaseProcess]
    results: mp.Queue

    def join(self, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order; on a rank failure or timeout the group is stopped and this raises."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        try:
            while len(got) < len(self.processes):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"EP group: ranks {sorted(set(range(len(self.processes))) - set(got))} "
                                       f"did not finish in {timeout_s}s")
                try:
                    rank, ok, value = self.results.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.processes) if r not in got and p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"EP rank(s) {dead} died with exit codes "
                                           f"{[self.processes[r].exitcode for r in dead]}") from None
                    continue
                if not ok:
                    raise RuntimeError(f"EP rank {rank} failed:\n{value}")
                got[rank] = value
        except BaseException:
            self.terminate()
            raise
        for p in self.processes:
            p.join()
        return [got[r] for r in range(len(self.processes))]

    def terminate(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=10)


def launch_ep_group(model_path: str, ep_size: int, rank_main: Callable[..., Any], args: Sequence[Any] = (), *,
                    engine_kwargs: dict[str, Any] | None = None, ep: EPConfig | None = None,
                    backend: str = "auto", host: str = "127.0.0.1", port: int | None = None,
                    torch_threads: int | None = 1, start_method: str = "spawn",
                    preload: Sequence[str] = (), wait: bool = True, timeout_s: float | None = None,
                    rank_setup: Callable[[int], None] | None = None) -> list[Any] | EPGroupHandle:
    """Run `rank_main(DPEngine, *args)` on `ep_size` ranks of one EP / attention-DP group.

    `start_method="forkserver"` with `preload=["moebus.engine.distributed"]` pays the torch import
    once per parent process instead of once per rank (tests, benchmarks); NCCL needs "spawn" or
    "forkserver" (never "fork" after CUDA init). The rendezvous listens on `host`:`port` in rank 0's
    process; pass `port` where `host` is not this process's own address (rank 0 in another namespace).
    """
    if ep_size < 1:
        raise ValueError("ep_size must be >= 1")
    spec = RankSpec(str(model_path), ep_size, f"tcp://{host}:{port or free_port(host)}", resolve_backend(backend),
                    dict(engine_kwargs or {}), ep or EPConfig(), torch_threads, rank_setup)
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    if torch_threads:  # the child's OpenMP pool size is fixed when torch loads
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    try:
        procs = [ctx.Process(target=_rank_entry, args=(r, spec, rank_main, tuple(args), results),
                             name=f"moebus-ep{r}", daemon=True) for r in range(ep_size)]
        for p in procs:
            p.start()
    finally:
        if torch_threads:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
    handle = EPGroupHandle(procs, results)
    return handle.join(timeout_s) if wait else handle
