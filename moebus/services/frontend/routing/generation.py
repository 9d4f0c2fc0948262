"""One request's life at the frontend: route it, receive its chunks, migrate it, abort it.

Migration: when the worker holding a request is lost (missed heartbeats), drains, or fails with a
retryable error, the request moves to another worker, excluding the ones that failed it, with
every open choice carrying the tokens the client already has (`GenerateRequest.resume`); the new
worker's engine continues from them (engine/resume.py), so the client sees one uninterrupted
response, streamed or not: no token repeated or missing, greedy output identical to an
undisturbed run. A request moves at most `max_migrations` times. A request the engine failed by
itself (invalid, or its own state raised) never moves, and one that broke `max_worker_failures`
workers (they died or their engine failed while holding it) is not sent to another: a poison
request cannot walk the fleet. A moved request is a suspect: workers run suspects in batches
apart from the rest and split a batch that breaks their engine again (worker/quarantine.py); one
whose batch died with its worker goes on alone (`isolate`), so a poison that kills processes
breaks at most one worker more than `max_worker_failures`. A draining worker handing a request
over does not count as a failure. Chunks of an older attempt are ignored, so a late worker cannot interleave with its
replacement. A split request (prefill worker, then decode worker) takes chunks from both, in
sequence-number order (they come from two publishers); the prefill worker matters until the
decode worker has streamed, since the KV hand-off between them may still be under way.

Bus blips: chunks published while the frontend was cut off (or not yet re-subscribed) are lost at
the server. A gap in a choice's sequence numbers that lasts `gap_wait_s`, and every reconnect of
the frontend's own bus (the tail may be lost with nothing after it to show a gap), make it ask the
worker for the chunks after those it has (`worker.replay.<id>`, the worker's replay buffer); a
worker that no longer has them (it restarted) is treated as lost: the request migrates. Time the
bus was down does not count as the worker's silence (`stream_idle_timeout_s`), but a stream whose
bus stays down `bus_outage_s` fails (503): nothing can reach a worker without it.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter

from moebus.shared.bus import Bus
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import AbortRequest, GenerateAccepted, GenerateRequest, TokenChunk
from moebus.shared.messages.generate import ReplayReply, ReplayRequest, ResumedChoice
from moebus.shared.subjects import Subjects

from ..config import FrontendConfig
from .ordering import ChunkOrder
from .spans import stage_span

RETRY_S = 0.25  # a replay the worker could not answer yet (it is reconnecting too) is asked again after this
TICK_S = 0.5  # while the bus is down, how often a stream checks how long it has been


@dataclass(frozen=True, slots=True)
class Lost:
    worker_id: str


@dataclass(frozen=True, slots=True)
class BusChanged:
    """The frontend's bus went down (False) or came back (True)."""

    connected: bool


@dataclass(frozen=True, slots=True)
class Stalled:
    """Nothing came when something should have: the request fails (or moves, if retryable)."""

    error: ServiceError
    retryable: bool
    worker_id: str | None


class Routes(Protocol):
    """What a Generation needs of the stream router (router.StreamRouter): the bus, its chunks
    delivered to it while registered, replays, and the counters of moves and aborts."""

    cfg: FrontendConfig
    bus: Bus
    subjects: Subjects
    migrations: Counter
    aborts: Counter

    def register(self, gen: Generation) -> None: ...

    def unregister(self, gen: Generation) -> None: ...

    async def replay(self, worker: str, req: ReplayRequest) -> ReplayReply | None: ...


class Generation:
    def __init__(self, router: Routes, req: GenerateRequest) -> None:
        self.router, self.req = router, req
        self.queue: asyncio.Queue[TokenChunk | Lost | BusChanged] = asyncio.Queue()
        self.worker_id: str | None = None
        self.decode_worker_id: str | None = None  # split requests: the second half's worker
        self._decoding = False  # the decode worker has streamed: the prefill worker no longer matters
        self.open = set(range(req.params.n))  # choices the worker is still generating
        self.sent: dict[int, list[int]] = {}  # per choice, the tokens passed on to the client
        self.order = ChunkOrder(req.params.n)  # this attempt's chunks, passed on in order
        self._cut = False  # the consumer ended a choice early: the worker must be told
        self.worker_failures = 0  # workers that died or whose engine failed while holding this request
        self._isolate = False  # its next attempts run alone (its batch of suspects died: worker quarantine)
        self.migrations = 0
        self._heard = time.monotonic()  # when something last came for this request
        self._resync_at: float | None = None  # when to ask the worker for chunks after ours (reconnect)
        self._orphans: set[str] = set()  # workers told to stop this request (they streamed it, not ours)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def done(self) -> bool:
        return not self.open

    async def start(self) -> None:
        """Route the first attempt; raises the balancer's ServiceError (-> HTTP 4xx/5xx)."""
        self.router.register(self)
        try:
            await self._route()
        except BaseException:
            self.router.unregister(self)
            raise

    async def _route(self) -> None:
        cfg = self.router.cfg
        # Idempotent: asked again after route_attempt_s without a reply (see FrontendConfig). A balancer
        # still subscribed but silent is paused, not gone (shared/liveness.py): as long as a silent worker.
        accepted = await self.router.bus.request(self.router.subjects.balancer_route, self.req, GenerateAccepted,
                                                 timeout=min(cfg.route_attempt_s, cfg.route_timeout_s),
                                                 wait_for_responders_s=max(cfg.restart_wait_s, cfg.route_timeout_s),
                                                 idempotent=True, paused_wait_s=cfg.stream_idle_timeout_s)
        self.worker_id, self.decode_worker_id = accepted.worker_id, accepted.decode_worker_id

    def watches(self, worker_id: str) -> bool:
        """Whether losing this worker loses the request (the prefill worker stops mattering
        once the decode worker streams)."""
        if worker_id == self.decode_worker_id:
            return True
        return worker_id == self.worker_id and not self._decoding

    def _workers(self) -> list[str]:
        return [w for w in (self.worker_id, self.decode_worker_id) if w]

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        self._heard = time.monotonic()
        while self.open:
            for item in [*await self._next(), None]:  # None: the end of what came together
                if isinstance(item, TokenChunk) and not item.error:
                    if item.attempt == self.req.attempt and item.worker_id in self._workers():
                        self._decoding |= item.worker_id == self.decode_worker_id
                        self.order.take(item)
                    elif item.worker_id not in self._workers():  # an abandoned attempt, or a route asked twice
                        await self._abort_orphan(item.worker_id)
                    continue
                for chunk in self.order.ready():  # before a failure too: a migration resumes from them
                    self.sent.setdefault(chunk.index, []).extend(chunk.token_ids)
                    if chunk.finished:
                        self.open.discard(chunk.index)
                    yield chunk
                if item is None:
                    continue
                if isinstance(item, Lost):
                    if not self.watches(item.worker_id):
                        continue
                    err, retryable = ServiceError(ErrorCode.WORKER_LOST, f"worker {item.worker_id} was lost"), True
                    failed = item.worker_id
                elif isinstance(item, Stalled):
                    err, retryable, failed = item.error, item.retryable, item.worker_id
                elif item.attempt != self.req.attempt or item.worker_id not in self._workers():
                    continue  # an error of an abandoned attempt
                else:
                    err = ServiceError(item.error, item.error_message or item.error, param=item.error_param)
                    retryable = item.retryable
                    failed = item.failed_worker or item.worker_id
                if retryable and err.code is not ErrorCode.DRAINING:
                    self.worker_failures += 1
                    if self.req.suspect and not self.req.isolate and not isinstance(item, TokenChunk):
                        # its batch of suspects died with the worker (one that breaks its engine splits
                        # the batch itself, quarantine.py): who killed it is unknown, so it goes on alone
                        self._isolate = True
                    elif self.worker_failures >= self.router.cfg.max_worker_failures:  # poison: fail it for good
                        err, retryable = ServiceError(ErrorCode.REQUEST_FAILED, f"{err.message} (the request failed "
                                                      f"on {self.worker_failures} workers; it is not sent to "
                                                      "another)"), False
                if not retryable or self.migrations >= self.router.cfg.max_migrations:
                    raise err
                await self._migrate(failed, err.code)
                break  # what else came belongs to the abandoned attempt

    async def _next(self) -> list[TokenChunk | Lost | Stalled]:
        """What to act on next: a queued chunk or loss; chunks asked again from the worker (a gap
        that lasted gap_wait_s, or the bus came back); or a stall (silence, the bus down too long)."""
        while True:
            now = time.monotonic()
            due = self._replay_due()
            if due is not None and due <= now and self.router.bus.connected:
                if got := await self._replay():
                    return got
                continue
            try:
                if self.queue.empty():  # (asyncio.timeout, not wait_for: no task per chunk on 3.11)
                    async with asyncio.timeout(self._wait_s(now, due)):
                        item = await self.queue.get()
                else:
                    item = self.queue.get_nowait()
            except TimeoutError:
                if (stall := self._stalled()) is not None:
                    return [stall]
                continue
            if isinstance(item, BusChanged):
                if item.connected:
                    self._resync_at = time.monotonic()
                continue
            self._heard = time.monotonic()
            return [item]

    def _replay_due(self) -> float | None:
        gap = None if self.order.gap_since is None else self.order.gap_since + self.router.cfg.gap_wait_s
        return min((t for t in (gap, self._resync_at) if t is not None), default=None)

    def _wait_s(self, now: float, due: float | None) -> float:
        """Until the worker's silence would be too long or a replay is due; ticks while the bus is down."""
        since = max(self._heard, self.router.bus.evidence_since)  # our own outage is not its silence
        if since == math.inf:
            return TICK_S
        end = since + self.router.cfg.stream_idle_timeout_s
        return max(0.01, (end if due is None else min(end, due)) - now)

    def _stalled(self) -> Stalled | None:
        bus, cfg, now = self.router.bus, self.router.cfg, time.monotonic()
        stuck = self.decode_worker_id if self._decoding else self.worker_id
        down = bus.down_for(now)
        if down > cfg.bus_outage_s:
            why = "is closed" if down == math.inf else f"has been down for {down:.0f}s"
            return Stalled(ServiceError(ErrorCode.UNAVAILABLE, f"the message bus connection {why}"), False, stuck)
        idle = cfg.stream_idle_timeout_s
        if now - max(self._heard, bus.evidence_since) > idle:
            return Stalled(ServiceError(ErrorCode.TIMEOUT, f"no tokens for {idle:g}s from {stuck}"), True, stuck)
        return None

    async def _replay(self) -> list[TokenChunk | Lost]:
        """The chunks after those we have, from the request's worker(s); Lost when a worker that
        matters no longer has them (it restarted, or let them go): the request then migrates."""
        self._resync_at = None
        gap = self.order.gap_since is not None
        req = ReplayRequest(request_id=self.request_id, attempt=self.req.attempt, from_seq=self.order.wanted(self.open))
        got: list[TokenChunk | Lost] = []
        for worker in self._workers():
            reply = await self.router.replay(worker, req)
            if reply is None:  # not back on the bus yet (or dead: the balancer will say so)
                self._resync_at = time.monotonic() + RETRY_S
            elif reply.gone and self.watches(worker):
                return [Lost(worker)]
            elif not reply.gone:
                self._heard = time.monotonic()  # it answers: alive
                got += reply.chunks
                if reply.more:
                    self._resync_at = time.monotonic()
        if gap and self._resync_at is None:
            self.order.gap_since = time.monotonic()  # ask again if the gap stays open
            self.order.asks += 1
            if self.order.asks > 3:  # answered, and still not filled: give up on this worker
                return [Lost(self.decode_worker_id if self._decoding else self.worker_id or "")]
        return got

    async def _migrate(self, failed: str | None, reason: ErrorCode) -> None:
        with stage_span(self.router.bus.tracing, "migrate", reason=reason.value, failed_worker=failed,
                        attempt=self.req.attempt + 1):
            await self._move(failed, reason)

    async def _move(self, failed: str | None, reason: ErrorCode) -> None:
        """Rerun the open choices on another worker from the tokens the client already has."""
        for worker in self._workers():  # alive after all (a NATS blip looks like a death)? stop the old attempt
            await self.router.bus.publish(self.router.subjects.worker_abort(worker),
                                          AbortRequest(request_id=self.request_id, reason="migrated",
                                                       attempt=self.req.attempt))
        fresh = self.open == set(range(self.req.params.n)) and not any(self.sent.values())
        resume = [] if fresh else [ResumedChoice(index=k, token_ids=self.sent.get(k, [])) for k in sorted(self.open)]
        excluded = [*self.req.exclude_workers, *([failed] if failed else [])]
        self.req = self.req.model_copy(update={"attempt": self.req.attempt + 1, "exclude_workers": excluded,
                                               "suspect": self.worker_failures > 0, "isolate": self._isolate,
                                               "resume": resume})
        self.worker_id = self.decode_worker_id = None
        self._decoding = False
        self.order, self._resync_at = ChunkOrder(self.req.params.n), None
        self.migrations += 1
        self.router.migrations.labels(reason.value, "fresh" if fresh else "resumed").inc()
        await self._route()

    async def _abort_orphan(self, worker_id: str) -> None:
        """A worker that streams this request without holding it for us stops: a route repeated
        after a balancer died with the first ask can have reached two workers (once per worker)."""
        if worker_id in self._orphans:
            return
        self._orphans.add(worker_id)
        await self.router.bus.publish(self.router.subjects.worker_abort(worker_id),
                                      AbortRequest(request_id=self.request_id, reason="orphan"))
        self.router.aborts.inc()

    def finish_choice(self, index: int) -> None:
        """The consumer ended a choice early (a stop string it matched itself)."""
        self.open.discard(index)
        self._cut = True

    async def close(self) -> None:
        """Forget the request; if it is still running (client gone, stop string), abort it on its worker."""
        self.router.unregister(self)
        if (self.open or self._cut) and self.worker_id:
            with stage_span(self.router.bus.tracing, "abort", generation_id=self.request_id, cut=self._cut):
                for worker in self._workers():
                    await self.router.bus.publish(self.router.subjects.worker_abort(worker),
                                                  AbortRequest(request_id=self.request_id))
            self.router.aborts.inc()
