"""Service base: an async context manager that owns the bus connection and the control plane.

Every service answers ``health``/``ready`` (service-wide and per instance), ``stats`` and
``drain`` (per instance: shut down as on SIGTERM) over NATS, publishes a heartbeat (with its load)
every `heartbeat_interval_s`, and can
serve ``/healthz`` ``/readyz`` ``/metrics`` over HTTP for Kubernetes probes. Shutdown order: mark
draining (a last heartbeat tells watchers), `teardown()` (the subclass finishes its work), drain.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, ClassVar, Self

from nats.aio.msg import Msg
from opentelemetry.trace import TracerProvider
from pydantic import BaseModel, ConfigDict, Field

from .bus import Bus, BusConfig
from .cluster_view import ClusterView
from .codec import Message
from .errors import ErrorCode, NoResponders, ServiceError
from .messages import HealthReply, Heartbeat, Load
from .metrics import Metrics
from .subjects import Subjects, check_token
from .trace_export import build_provider, flush_provider
from .tracing import Tracing

log = logging.getLogger(__name__)
# Set by a supervisor (`moebus up`) on a process it started again: how many times it did, for the
# heartbeat (operators see it in `moebus status`). An environment variable, not a config field:
# it describes the process, not the service it runs.
RESTARTS_ENV = "MOEBUS_RESTARTS"


def restarts_from_env(environ: Mapping[str, str] = os.environ) -> int:
    try:
        return max(0, int(environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nats_url: str = "nats://127.0.0.1:4222"  # comma-separated list for a cluster
    instance_id: str | None = None  # default: <service>-<random>
    subject_prefix: str = "moebus.v1"  # every subject starts with it (isolates stacks on one NATS)
    heartbeat_interval_s: float = 1.0  # seconds between heartbeats (watchers drop it after ~3 missed)
    http_port: int | None = None  # probes + /metrics; None: off
    # Address of the probes / metrics server: this machine only, unless asked (a pod's kubelet
    # probes its IP: deploy/ sets 0.0.0.0).
    http_host: str = "127.0.0.1"
    drain_timeout_s: float = 10.0  # on shutdown, how long the bus connection may take to drain
    # Monitoring URL of the NATS node on this host (nats-server's `http`, e.g. http://127.0.0.1:8222):
    # a silent peer on a node ours no longer routes to is waited for, not given up (shared/liveness.py).
    nats_monitor_url: str | None = None
    # ...for this long after its last sign of life (then its host is taken as gone).
    partition_grace_s: float = Field(120.0, ge=0)


class Empty(Message):
    pass


class Stats(Message):
    service: str
    instance_id: str
    stats: dict[str, Any] = {}


class Service:
    name: ClassVar[str] = "service"

    def __init__(self, cfg: ServiceConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.cfg = cfg
        self.instance_id = check_token(cfg.instance_id or f"{self.name}-{uuid.uuid4().hex[:8]}")
        self.subjects = Subjects(cfg.subject_prefix)
        # None: this service's own, exporting as the environment says (trace_export.py), flushed at shutdown
        self._own_provider = None if tracer_provider is not None else build_provider(self.name, self.instance_id)
        self.tracing = Tracing(self.name, tracer_provider or self._own_provider)
        self.metrics = Metrics(self.name)
        self.draining = False
        self._bus: Bus | None = None
        self.cluster_view = ClusterView(cfg.nats_monitor_url)  # which bus nodes ours routes to (partitions)
        self._started = time.monotonic()
        self.incarnation = uuid.uuid4().hex[:12]  # this process's life (see Heartbeat.incarnation)
        self.restarts = restarts_from_env()
        self._tasks: set[asyncio.Task] = set()
        self._probes = None
        self._closed = False
        self.exit_requested = asyncio.Event()  # set when the service cannot go on: its process should exit
        self.exit_reason: str | None = None
        self.stop_requested = asyncio.Event()  # a `drain` control message: shut down gracefully, exit 0

    # ---- hooks for subclasses -------------------------------------------------------------
    async def setup(self) -> None:
        """Subscribe endpoints, start background work."""

    async def teardown(self) -> None:
        """Stop taking work and finish (or hand back) what is in flight; the bus is still up."""

    @property
    def ready(self) -> bool:
        return True

    @property
    def healthy(self) -> bool:
        return True

    def load(self) -> Load | None:
        return None

    def model(self) -> str | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._bus

    async def __aenter__(self) -> Self:
        self._started = time.monotonic()
        servers = [s.strip() for s in self.cfg.nats_url.split(",") if s.strip()]
        self._bus = await Bus.connect(BusConfig(servers=servers, name=self.instance_id), self.tracing, self.metrics)
        try:
            await self._subscribe_control()
            await self.setup()
            await self._until_routable()
            self.spawn(self._heartbeat_loop())
            if self.cfg.http_port is not None:
                from .probes import start_probe_server  # aiohttp only where probes are on

                self._probes = await start_probe_server(self, self.cfg.http_host, self.cfg.http_port)
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.draining = True
        try:
            if self.bus.connected:
                await self.publish_heartbeat()
            await self.teardown()
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.bus.drain(self.cfg.drain_timeout_s)
            if self._probes is not None:
                await self._probes.cleanup()
            if self._own_provider is not None:
                await flush_provider(self._own_provider)

    def request_exit(self, reason: str) -> None:
        """Ask the process running this service to shut it down and exit non-zero (a supervisor
        restarts it), instead of staying alive but useless."""
        log.error("%s cannot go on: %s", self.instance_id, reason)
        self.exit_reason = reason
        self.exit_requested.set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A background task that lives until shutdown; its crash is logged, not swallowed silently."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s background task failed", self.instance_id, exc_info=task.exception())

    # ---- control plane ---------------------------------------------------------------------
    def health_reply(self) -> HealthReply:
        return HealthReply(service=self.name, instance_id=self.instance_id,
                           status="draining" if self.draining else "ok",
                           ready=self.ready and not self.draining, uptime_s=time.monotonic() - self._started)

    async def _subscribe_control(self) -> None:
        s, n, i = self.subjects, self.name, self.instance_id

        async def health(_: Empty, __: Msg) -> HealthReply:
            if not self.healthy:
                raise ServiceError(ErrorCode.UNAVAILABLE, f"{i} is unhealthy")
            return self.health_reply()

        async def ready(_: Empty, __: Msg) -> HealthReply:
            reply = self.health_reply()
            if not reply.ready:
                raise ServiceError(ErrorCode.UNAVAILABLE, f"{i} is not ready")
            return reply

        async def stats(_: Empty, __: Msg) -> Stats:
            return Stats(service=n, instance_id=i, stats=self.stats())

        async def drain(_: Empty, __: Msg) -> HealthReply:
            log.info("%s: drain requested over the bus", i)
            self.stop_requested.set()
            return self.health_reply()

        for subject, handler in ((s.health(n), health), (s.health(n, i), health),
                                 (s.ready(n), ready), (s.ready(n, i), ready), (s.stats(n, i), stats),
                                 (s.drain(n, i), drain)):
            await self.bus.subscribe(subject, Empty, handler, concurrent=False, endpoint=subject.split(".")[-1])

    async def _until_routable(self, timeout: float = 2.0) -> None:
        # A probe request, not only a flush: with nats-py's flush alone the PONG could come back
        # before the server had our SUBs (Bus.flush now waits for them; the probe stays as the end
        # to end check). SUBs are applied in order, so once a probe subscribed after all our
        # endpoints routes back to us, every endpoint does.
        subject = self.subjects.probe(self.name, self.instance_id)

        async def probe(_: Empty, __: Msg) -> Empty:
            return Empty()

        sub = await self.bus.subscribe(subject, Empty, probe, concurrent=False, traced=False, endpoint="probe")
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    await self.bus.request(subject, Empty(), Empty, 1.0)
                    return
                except NoResponders:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)
        finally:
            await sub.unsubscribe()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.name, instance_id=self.instance_id, ts=time.time(),
                         interval_s=self.cfg.heartbeat_interval_s, ready=self.ready and self.healthy,
                         draining=self.draining, model=self.model(), load=self.load(), incarnation=self.incarnation,
                         restarts=self.restarts, bus_node=self.bus.node)

    async def publish_heartbeat(self) -> None:
        await self.bus.publish(self.subjects.heartbeat(self.name, self.instance_id), self.heartbeat())

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                if self.bus.connected:
                    await self.publish_heartbeat()
            except Exception:  # a missed beat is survivable; a dead loop is not
                log.warning("heartbeat failed", exc_info=True)
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
