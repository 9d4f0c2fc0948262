"""BalancerService: picks a worker for each request and tells frontends when one dies.

`route` (queue group: any replica may answer; each keeps its own table from the heartbeats that
all of them receive) forwards the request to the best worker's `generate.<id>` and returns its
GenerateAccepted. Overloaded or vanished workers are skipped for the next candidate. A worker
that misses heartbeats is dropped and announced on `balancer.worker_lost`; frontends rerun the
requests it had not started.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.aio.msg import Msg

from moebus.shared.errors import ErrorCode, NoResponders, RequestTimeout, ServiceError
from moebus.shared.messages import AbortRequest, GenerateAccepted, GenerateRequest, Heartbeat, WorkerLost
from moebus.shared.service import Service
from moebus.shared.subjects import Queues

from .config import BalancerConfig
from .table import WorkerTable


class BalancerService(Service):
    name = "balancer"

    def __init__(self, cfg: BalancerConfig, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: BalancerConfig = cfg
        self.table = WorkerTable(cfg.missed_heartbeats)
        self._m_routed = self.metrics.counter("routed_total", "Route outcomes", ["outcome"])
        self._m_lost = self.metrics.counter("workers_lost_total", "Workers dropped for missed heartbeats")
        self._m_workers = self.metrics.gauge("workers", "Workers in the table")

    def stats(self) -> dict[str, Any]:
        return {"workers": self.table.snapshot()}

    async def setup(self) -> None:
        s = self.subjects
        await self.bus.subscribe(s.heartbeat_all("worker"), Heartbeat, self._on_heartbeat, concurrent=False,
                                 endpoint="heartbeat")
        await self.bus.subscribe(s.balancer_route, GenerateRequest, self.route, queue=Queues.BALANCER,
                                 endpoint="route")
        self.spawn(self._reaper())

    async def _on_heartbeat(self, beat: Heartbeat, _: Msg) -> None:
        self.table.observe(beat, time.monotonic())
        self._m_workers.set(len(self.table))

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s / 2)
            for worker_id in self.table.expire(time.monotonic()):
                self._m_lost.inc()
                await self.bus.publish(self.subjects.balancer_worker_lost, WorkerLost(worker_id=worker_id))
            self._m_workers.set(len(self.table))

    async def route(self, req: GenerateRequest, _: Msg) -> GenerateAccepted:
        tried = set(req.exclude_workers)
        overloaded = False
        await self._await_first_worker(req.model, tried)
        while candidates := self.table.candidates(req.model, time.monotonic(), tried):
            worker = candidates[0].worker_id
            tried.add(worker)
            self.table.assigned(worker)
            try:
                accepted = await self.bus.request(self.subjects.worker_generate(worker), req, GenerateAccepted,
                                                  timeout=self.cfg.worker_timeout_s)
            except ServiceError as e:
                self.table.assigned(worker, -1)
                if not await self._next_candidate(e, req, worker):
                    raise
                overloaded |= e.code is ErrorCode.OVERLOADED
                continue
            self._m_routed.labels("ok").inc()
            return accepted
        if overloaded:
            self._m_routed.labels("overloaded").inc()
            raise ServiceError(ErrorCode.OVERLOADED, "every worker's queue is full", retry_after=1)
        self._m_routed.labels("unavailable").inc()
        raise ServiceError(ErrorCode.UNAVAILABLE, f"no live worker serves {req.model!r}", retry_after=2)

    async def _await_first_worker(self, model: str, exclude: set[str]) -> None:
        """Right after a (re)start the table fills within one heartbeat interval: wait for it
        rather than answer 503 to the first requests."""
        deadline = self._started + self.cfg.heartbeat_interval_s * 1.5
        while not self.table.candidates(model, time.monotonic(), exclude) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _next_candidate(self, e: ServiceError, req: GenerateRequest, worker: str) -> bool:
        """Whether a worker's failure means "try another one" (else it is the request's fault)."""
        if isinstance(e, NoResponders):
            self.table.skip(worker, time.monotonic())  # gone or draining; heartbeats will tell which
            return True
        if isinstance(e, RequestTimeout):
            # It may have accepted after all: make sure it does not run a request nobody awaits.
            await self.bus.publish(self.subjects.worker_abort(worker),
                                   AbortRequest(request_id=req.request_id, reason="route timeout"))
            return True
        if e.code in (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE):
            return True
        self._m_routed.labels(e.code.value).inc()
        return False
