"""BalancerService: picks a worker for each request and tells frontends when one dies.

`route` (queue group: any replica may answer; each keeps its own table from the heartbeats that
all of them receive) checks the request against the frontend's bounds (cfg.limits: BAD_REQUEST
over one), then forwards it to the best worker's `generate.<id>` and returns its GenerateAccepted.
"Best" is the cheapest estimated prefill given the prompt prefix each worker
caches (the balancer's own prefix index, fed by the KV events workers and the broker publish:
kv_rank.py; no request to anyone while routing), then the least loaded. Overloaded or vanished workers are
skipped for the next candidate. A worker that misses heartbeats, or whose heartbeat comes from a new
process under the same id (restarted), is announced on `balancer.worker_lost`; frontends move its
requests to other workers. Missed beats alone only stop routing to it: it is lost when its health
subject has no responders (the server closed its connection: it died), not while it is merely
paused or starved (the subscription stays; the probe times out) and its requests wait for it. Only beats missed while the balancer itself could hear them count: after
its own reconnect, a worker has the bus's settle time plus its full allowance to beat again.

Disaggregated mode: the decode worker is asked first (it starts waiting for the KV), then the
prefill worker, with one KVTransferSpec naming both; the accept reply names both workers. A
missing pool, n > 1 or a migrated request (resume) runs the request whole, on the decode pool when
it has a worker.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from moebus.kv.index import PrefixIndex
from moebus.shared.errors import ErrorCode, NoResponders, RequestTimeout, ServiceError
from moebus.shared.liveness import Verdict, probe
from moebus.shared.messages import (
    AbortRequest,
    GenerateAccepted,
    GenerateRequest,
    Heartbeat,
    KVEvent,
    KVTransferSpec,
    WorkerLost,
)
from moebus.shared.service import Service
from moebus.shared.subjects import Queues
from moebus.shared.tracing import Attr, annotate

from .config import BalancerConfig
from .kv_rank import KVRanker
from .packing import pack_colocated
from .policy import StaticOrder
from .route_memo import RouteMemo
from .spans import route_attributes
from .stalls import LoopStalls
from .table import WorkerEntry, WorkerTable

log = logging.getLogger(__name__)
PREFILL, DECODE = ("prefill", "both"), ("decode", "both")


@dataclass(slots=True)
class _Route:
    """One route call's own state (route calls run concurrently: nothing of it lives on the service)."""

    tried: set[str] = field(default_factory=set)  # workers offered this request (or excluded by the frontend)
    prefill_tokens: dict[str, float] = field(default_factory=dict)  # the KV ranking's estimate per worker
    overloaded: bool = False  # some worker refused it as overloaded: 429 rather than 503


class BalancerService(Service):
    name = "balancer"

    def __init__(self, cfg: BalancerConfig, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: BalancerConfig = cfg
        self.table = WorkerTable(cfg.missed_heartbeats)
        # our own stalls do not count as workers' silence (stalls.py); forgotten after a few allowances
        self.stalls = LoopStalls(horizon_s=4 * cfg.missed_heartbeats * cfg.heartbeat_interval_s,
                                 min_lag_s=cfg.heartbeat_interval_s / 10)
        self._m_routed = self.metrics.counter("routed_total", "Route outcomes", ["outcome"])
        self._m_lost = self.metrics.counter("workers_lost_total", "Workers dropped for missed heartbeats")
        self._m_workers = self.metrics.gauge("workers", "Workers in the table")
        self.index = PrefixIndex()  # what every worker (and the broker's tiers) caches, from their KV events
        self.ranker = KVRanker(self.index, self.metrics) if cfg.kv_aware and cfg.policy == "kv" else None
        self.static = None if cfg.policy == "kv" else StaticOrder(cfg.policy, cfg.policy_seed)
        self.picks: dict[str, int] = {}  # worker id -> requests routed there (both halves of splits)
        self.memo = RouteMemo(cfg.route_memo_s, on_repeat=self._m_routed.labels("repeat").inc)

    def stats(self) -> dict[str, Any]:
        kv = {"queries": self.ranker.queries, "hits": self.ranker.hits,
              "holders": self.index.holder_sizes()} if self.ranker else {}
        return {"workers": self.table.snapshot(time.monotonic()), "mode": self.cfg.mode, "policy": self.cfg.policy, "kv": kv,
                "picks": dict(self.picks)}

    async def setup(self) -> None:
        s = self.subjects
        if self.ranker is not None:  # (in order, like the broker's; one per holder tick: untraced)
            await self.bus.subscribe(s.kvbroker_events, KVEvent, self._on_kv_event, concurrent=False, traced=False,
                                     endpoint="kv_events")
        await self.bus.subscribe(s.heartbeat_all("worker"), Heartbeat, self._on_heartbeat, concurrent=False,
                                 endpoint="heartbeat")
        await self.bus.subscribe(s.balancer_route, GenerateRequest, self.route, queue=Queues.BALANCER,
                                 endpoint="route")
        self.spawn(self._reaper())

    async def _on_heartbeat(self, beat: Heartbeat, _: Msg) -> None:
        if self.table.observe(beat, time.monotonic()):
            await self._announce_lost(beat.instance_id, "restarted")
        self._m_workers.set(len(self.table))

    async def _on_kv_event(self, ev: KVEvent, _: Msg) -> None:
        now = time.monotonic()
        self.index.apply(ev, now)
        self.index.expire(now, self.cfg.kv_holder_ttl_s)

    async def _announce_lost(self, worker_id: str, reason: str) -> None:
        """Frontends move the requests the worker held; split halves waiting on it give up."""
        log.warning("%s: worker %s lost (%s)", self.instance_id, worker_id, reason)
        self._m_lost.inc()
        self.index.remove_holder(worker_id)
        await self.bus.publish(self.subjects.balancer_worker_lost, WorkerLost(worker_id=worker_id, reason=reason))

    async def _reaper(self) -> None:
        period = self.cfg.heartbeat_interval_s / 2
        while True:
            due = time.monotonic() + period
            await asyncio.sleep(period)
            self.stalls.record(due, time.monotonic())
            if self.table.silent(time.monotonic(), self.bus.evidence_since, self.stalls.since) \
                    and await self._hearing():
                silent = self.table.silent(time.monotonic(), self.bus.evidence_since, self.stalls.since)
                for worker_id, verdict in zip(silent, await asyncio.gather(*map(self._probe, silent)), strict=True):
                    await self._judge(worker_id, verdict)
            self._m_workers.set(len(self.table))

    async def _probe(self, worker_id: str) -> Verdict:
        entry = self.table.get(worker_id)
        return await probe(self.bus, self.subjects, "worker", worker_id,
                           max(self.cfg.heartbeat_interval_s, self.cfg.probe_timeout_s),
                           node=entry.beat.bus_node if entry else None, view=self.cluster_view,
                           silent_since=entry.last_seen if entry else -math.inf, grace_s=self.cfg.partition_grace_s)

    async def _judge(self, worker_id: str, verdict: Verdict) -> None:
        now = time.monotonic()
        if verdict == "gone":
            if self.table.remove(worker_id):
                await self._announce_lost(worker_id, "missed heartbeats, connection closed")
        elif verdict == "alive":  # it answers: its beats are late, not stopped
            self.table.heard(worker_id, now)
        else:  # paused or unreachable: no new work until it beats again, its requests wait for it
            if verdict == "unreachable" and self.table.skip(worker_id, now):
                log.warning("%s: worker %s is across a partition: its requests wait for it", self.instance_id,
                            worker_id)

    async def _hearing(self) -> bool:
        """Whether the bus carries our traffic right now (a round trip to the server): silence is
        evidence against a worker only then, and beats that were queued behind it count first."""
        try:
            await self.bus.flush(timeout=max(self.cfg.heartbeat_interval_s, 0.5))
        except Exception:  # cut off (or the server is going away): judge nobody now
            return False
        return True

    async def route(self, req: GenerateRequest, msg: Msg) -> GenerateAccepted:
        try:  # the frontend's bounds again: a route from past it never reaches a worker (shared/limits.py)
            self.cfg.limits.check(req)
        except ServiceError:
            self._m_routed.labels("bad_request").inc()
            raise
        return await self.memo.once((req.request_id, req.attempt), lambda: self._route(req, msg))

    async def _route(self, req: GenerateRequest, msg: Msg) -> GenerateAccepted:
        r = _Route(tried=set(req.exclude_workers))
        await self._await_a_worker(req.model, r.tried)
        if self.cfg.mode == "disaggregated":
            accepted = await self._route_split(req, r)
        else:  # the request goes on as the frontend encoded it: no second encode on the way
            accepted = await self._dispatch(req, await self._ordered(req, r, None), r, msg.data)
        if accepted is not None:
            self._m_routed.labels("ok").inc()
            annotate({Attr.WORKER: accepted.worker_id, "moebus.decode_worker_id": accepted.decode_worker_id,
                      "moebus.route.offered": len(r.tried) - len(req.exclude_workers)})
            return accepted
        if r.overloaded:
            self._m_routed.labels("overloaded").inc()
            raise ServiceError(ErrorCode.OVERLOADED, "every worker's queue is full", retry_after=1)
        self._m_routed.labels("unavailable").inc()
        raise ServiceError(ErrorCode.UNAVAILABLE, f"no live worker serves {req.model!r}", retry_after=2)

    async def _ordered(self, req: GenerateRequest, r: _Route, roles: tuple[str, ...] | None,
                       kv_aware: bool = True) -> list[WorkerEntry]:
        cands = self.table.candidates(req.model, time.monotonic(), r.tried, roles)
        route_attributes(self.cfg, req, cands, roles)
        if self.static is not None:
            return self.static.order(cands)
        if kv_aware and self.ranker is not None:
            ranking = self.ranker.order(req, cands)
            r.prefill_tokens.update(ranking.prefill_tokens)
            return pack_colocated(ranking.entries, ranking.prefill_tokens)
        return pack_colocated(cands)

    async def _dispatch(self, req: GenerateRequest, ordered: list[WorkerEntry], r: _Route,
                        data: bytes | None = None) -> GenerateAccepted | None:
        """Offer the request to each candidate in turn; None when none of them took it. data: `req`
        already encoded (as received, unchanged)."""
        for entry in ordered:
            worker = entry.worker_id
            if worker in r.tried:
                continue
            r.tried.add(worker)
            # pending load until its next heartbeat: the ranking's estimate, else the whole prompt
            tokens = r.prefill_tokens.get(worker, float(len(req.prompt_token_ids)))
            self.table.assigned(worker, tokens=tokens)
            # Just after a NATS restart a worker may not have resubscribed yet: until our bus has
            # settled (Bus.evidence_since) its "no responders" is no evidence, so ask again meanwhile.
            settling = min(max(0.0, self.bus.evidence_since - time.monotonic()), self.bus.settle_s)
            try:
                accepted = await self.bus.request(self.subjects.worker_generate(worker), req if data is None else data,
                                                  GenerateAccepted, timeout=self.cfg.worker_timeout_s,
                                                  wait_for_responders_s=settling)
            except ServiceError as e:
                self.table.assigned(worker, -1, tokens)
                if not await self._next_candidate(e, req, worker):
                    raise
                r.overloaded |= e.code is ErrorCode.OVERLOADED
                continue
            self.picks[worker] = self.picks.get(worker, 0) + 1
            return accepted
        return None

    async def _route_split(self, req: GenerateRequest, r: _Route) -> GenerateAccepted | None:
        prefill = await self._ordered(req, r, PREFILL)
        decode = [e for e in await self._ordered(req, r, DECODE, kv_aware=False)
                  if e.beat.kv is not None and e.beat.kv.transfer_address]
        if len({e.worker_id for e in prefill + decode}) < 2:  # one worker cannot be both halves
            prefill = [] if decode else prefill
        # n > 1 and migrated requests (the prompt and the tokens so far prefill together) run whole
        if req.params.n != 1 or req.resume or not prefill or not decode:
            whole = req.model_copy(update={"stage": "aggregated", "kv_transfer": None})
            return await self._dispatch(whole, decode or prefill or await self._ordered(req, r, None), r)
        tid = f"{req.request_id}#{req.attempt}"
        for d in decode:
            spec = KVTransferSpec(transfer_id=tid, prefill_worker=prefill[0].worker_id, decode_worker=d.worker_id,
                                  address=d.beat.kv.transfer_address, timeout_s=self.cfg.kv_transfer_timeout_s)
            dec = await self._dispatch(req.model_copy(update={"stage": "decode", "kv_transfer": spec}), [d], r)
            if dec is None:
                continue
            pre_req = req.model_copy(update={"stage": "prefill", "kv_transfer": spec})
            pre = await self._dispatch(pre_req, [p for p in prefill if p.worker_id != d.worker_id], r)
            if pre is None:  # no prefill worker took it: the decode half must not wait for nothing
                await self.bus.publish(self.subjects.worker_abort(d.worker_id),
                                       AbortRequest(request_id=req.request_id, reason="no prefill worker"))
                return None
            return pre.model_copy(update={"decode_worker_id": dec.worker_id})
        return None

    async def _await_a_worker(self, model: str, exclude: set[str]) -> None:
        """No routable worker: wait up to 1.5 heartbeat intervals for one rather than answer 503
        at once. Right after a (re)start the table fills within one interval, and a worker dropped
        for missed beats (its process or ours starved of CPU a moment) is back with its next beat."""
        deadline = time.monotonic() + self.cfg.heartbeat_interval_s * 1.5
        while time.monotonic() < deadline and not self.table.candidates(model, time.monotonic(), exclude):
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
