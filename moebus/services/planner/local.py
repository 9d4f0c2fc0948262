"""Local actuator: worker processes on this machine.

Scale-out starts `python -m moebus.services.worker` with the configured WorkerConfig fields (plus
the pool's role, the planner's NATS and subject prefix). Scale-in sends one worker the per-instance
`drain` control message: it stops taking work, hands its requests over and exits 0. The worker is
one this actuator started (newest, then least loaded, first), else the least loaded one it sees.
Started but not yet seen workers count toward the pool (no double start while one boots); on
scale-in they are stopped first. Exited children are reaped every tick; they get SIGTERM when the
planner exits (and, on Linux, when it dies), so none outlives it.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict

from moebus.shared.bus import Bus
from moebus.shared.config_cli import to_cli_args
from moebus.shared.lifeline import die_with_parent
from moebus.shared.messages import HealthReply
from moebus.shared.messages.planner import PoolName
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects

from .config import LocalActuatorConfig
from .fleet import WorkerView

log = logging.getLogger(__name__)
ID_PREFIX: dict[PoolName, str] = {"both": "worker", "prefill": "prefill", "decode": "decode"}
DRAIN_RETRY_S = 30.0  # a drained worker still seen this long after the request gets asked again


class _Fields(BaseModel):
    """Any WorkerConfig fields, rendered as its flags by the one flag formatter (config_cli)."""

    model_config = ConfigDict(extra="allow")


@dataclass(slots=True)
class _Child:
    proc: subprocess.Popen
    pool: PoolName
    seq: int  # start order: the newest goes first
    log: IO[bytes] | None


class LocalActuator:
    name = "local"

    def __init__(self, cfg: LocalActuatorConfig, bus: Bus, subjects: Subjects, worker_defaults: dict[str, Any]) -> None:
        """worker_defaults: fields every worker needs from the planner (nats_url, subject_prefix...)."""
        self.cfg, self.bus, self.subjects = cfg, bus, subjects
        self.worker_defaults = worker_defaults
        self.children: dict[str, _Child] = {}
        self.drained: dict[str, float] = {}  # worker id -> when the drain was sent
        self.exits: dict[str, int] = {}  # reaped children -> exit code
        self._run = uuid.uuid4().hex[:4]  # ids stay unique across planner restarts
        self._seq = 0

    def stats(self) -> dict[str, Any]:
        return {"children": sorted(self.children), "drained": sorted(self.drained), "exits": dict(self.exits)}

    async def scale(self, pool: PoolName, desired: int, workers: Sequence[WorkerView]) -> None:
        self.reap()
        now = time.monotonic()
        seen = {w.worker_id for w in workers}
        self.drained = {i: t for i, t in self.drained.items() if i in seen or i in self.children}
        live = [w for w in workers if w.pool == pool and not w.draining and w.worker_id not in self.drained]
        booting = [i for i, c in self.children.items()
                   if c.pool == pool and i not in seen and i not in self.drained]
        excess = len(live) + len(booting) - desired
        for _ in range(-excess):
            self.start(pool)
        if excess <= 0:
            return
        for i in sorted(booting, key=lambda i: -self.children[i].seq)[:excess]:  # not serving yet: just stop it
            self.children[i].proc.terminate()
            self.drained[i] = now
            excess -= 1
        for w in sorted(live, key=self._drain_order)[:excess]:
            await self.drain(w.worker_id)
        for i, t in list(self.drained.items()):  # a lost drain request is sent again
            if i in seen and now - t > DRAIN_RETRY_S and any(w.worker_id == i and not w.draining for w in workers):
                await self.drain(i)

    def _drain_order(self, w: WorkerView) -> tuple[int, int, int]:
        child = self.children.get(w.worker_id)
        return (0, -child.seq, w.inflight) if child is not None else (1, 0, w.inflight)

    def start(self, pool: PoolName) -> str:
        instance = f"{ID_PREFIX[pool]}-{self._run}-{self._seq}"
        fields = {**self.cfg.worker, **self.worker_defaults, "instance_id": instance, "role": pool}
        cmd = [sys.executable, "-m", "moebus.services.worker", *to_cli_args(_Fields(**fields))]
        out = None
        if self.cfg.log_dir:
            Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.cfg.log_dir) / f"{instance}.log", "ab")  # noqa: SIM115
        # Own session: a Ctrl-C meant for the launcher does not reach workers past the planner.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                preexec_fn=die_with_parent(signal.SIGTERM))  # a drain
        self.children[instance] = _Child(proc, pool, self._seq, out)
        self._seq += 1
        log.info("started %s (pid %d)", instance, proc.pid)
        return instance

    async def drain(self, worker_id: str) -> None:
        self.drained[worker_id] = time.monotonic()
        try:
            await self.bus.request(self.subjects.drain("worker", worker_id), Empty(), HealthReply, timeout=2.0)
            log.info("drain sent to %s", worker_id)
        except Exception as e:  # gone already, or busy: the heartbeat table settles it
            log.warning("drain of %s: %s", worker_id, e)

    def reap(self) -> None:
        for i, c in list(self.children.items()):
            code = c.proc.poll()
            if code is None:
                continue
            del self.children[i]
            self.exits[i] = code
            if c.log is not None:
                c.log.close()
            (log.info if code == 0 else log.warning)("%s exited with code %d", i, code)

    async def close(self) -> None:
        """Stop every started worker (SIGTERM: each drains), kill those that outlive stop_timeout_s."""
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        while any(c.proc.poll() is None for c in self.children.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        self.reap()
