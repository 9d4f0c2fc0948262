"""WorkerService: runs one engine, takes routed requests, streams tokens to each request's inbox.

Lifecycle of a request: `generate.<id>` (admission: draining/unready -> unavailable, queue full ->
overloaded) -> GenerateAccepted reply -> TokenChunks on `reply_to` -> done, or `abort.<id>`.
n > 1 runs n engine requests ``<request_id>#<i>``. On drain, requests that have not produced a
token are handed back (retryable error chunk) so the frontend reruns them elsewhere.
Split requests (stage prefill / decode, see split.py) and the KV broker hooks (kv_link.py) are
only wired up for real engines; the toy engine runs aggregated requests only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import (
    AbortRequest,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    Heartbeat,
    KVInfo,
    Load,
    TokenChunk,
    WorkerLost,
)
from moebus.shared.service import Service
from moebus.shared.toy_model import TOY_MODEL

from .config import WorkerConfig
from .engine_loop import AddFailed, EngineLoop, Prefilled
from .engines import choice_params, make_engine
from .outputs import chunk_from_output
from .quarantine import Quarantine
from .split import SplitStages

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    req: GenerateRequest
    trace_headers: dict[str, str]  # the generate span's context, for every chunk of the stream
    accepted_at: float
    seq: list[int] = field(default_factory=list)
    open: set[int] = field(default_factory=set)  # choice indices not finished yet
    started: bool = False  # some token went out: no longer safe to hand back for a rerun
    params: list[Any] = field(default_factory=list)  # engine parameters per choice
    first_token: int | None = None  # stage prefill: the token streamed, handed to the decode worker

    def sub_ids(self) -> list[str]:
        return [f"{self.req.request_id}#{i}" for i in sorted(self.open)]


class WorkerService(Service):
    name = "worker"

    def __init__(self, cfg: WorkerConfig, engine_factory: Any = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: WorkerConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self.toy = cfg.model == TOY_MODEL  # a factory may wrap the toy engine too (fault-injection tests)
        self._factory = engine_factory or (lambda: make_engine(cfg))
        self.kv: Any = None  # EngineKV (real engines): engine-thread KV hooks
        self.link: Any = None  # WorkerKVLink: transports, broker index and tiers
        self.split = SplitStages(self)
        self.quarantine = Quarantine(self._add)  # suspects (their engine broke before) run alone
        self._beat_pending = False
        self._active: dict[str, _Active] = {}
        self._outbox: asyncio.Queue[tuple[str, TokenChunk | Handoff, dict[str, str]] | None] = asyncio.Queue()
        self._loop: EngineLoop | None = None
        self._generate_sub: Subscription | None = None
        self.counters = {"accepted": 0, "finished": 0, "aborted": 0, "rejected_overloaded": 0,
                         "handed_back": 0, "failed": 0, "handed_off": 0}
        m = self.metrics
        self._m_requests = m.counter("requests_total", "Requests by outcome", ["outcome"])
        self._m_ttft = m.histogram("time_to_first_token_seconds", "Accept to first token")
        self._m_tokens = m.counter("generated_tokens_total", "Tokens generated")
        self._m_queue = m.gauge("queued_requests", "Requests waiting for their first token")

    # ---- state -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._loop is not None and self._loop.ready.is_set() and self._loop.failed is None

    @property
    def healthy(self) -> bool:
        return self._loop is None or (self._loop.failed is None and self._loop.alive)

    def model(self) -> str | None:
        return self.served_model

    def queued(self) -> int:
        return sum(1 for a in self._active.values() if not a.started)

    def load(self) -> Load:
        s = self._loop.stats if self._loop else {}
        return Load(num_running=int(s.get("num_running", 0)), num_waiting=self.queued(),
                    max_waiting=self.cfg.max_queued, kv_blocks_free=int(s.get("kv_blocks_free", 0)),
                    kv_blocks_total=int(s.get("kv_blocks_total", 0)))

    def stats(self) -> dict[str, Any]:
        engine = dict(self._loop.stats) if self._loop else {}
        kv = dict(self.link.counters) if self.link is not None else {}
        return {"engine": engine, "active_requests": len(self._active), "queued": self.queued(), "role": self.cfg.role,
                "kv": kv, **self.counters}

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        beat.role = self.cfg.role
        if self.kv is not None and self.kv.block_size:
            beat.kv = KVInfo(namespace=self.kv.namespace, block_size=self.kv.block_size,
                             transfer_address=self.link.address if self.link is not None else None)
        return beat

    # ---- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        if not self.toy:
            from .kv_engine import EngineKV  # torch lives behind this import

            self.kv = EngineKV(self.cfg.kv_cpu_bytes)
        self._loop = EngineLoop(self._factory, asyncio.get_running_loop(), self._on_outputs, self._on_fatal,
                                on_ready=lambda: self.spawn(self.publish_heartbeat()),  # be routable at once
                                kv=self.kv, max_restarts=self.cfg.engine_restarts,
                                restart_backoff_s=self.cfg.engine_restart_backoff_s)
        self._loop.start()
        self.spawn(self._publisher())
        s, i = self.subjects, self.instance_id
        if self.kv is not None:
            from .kv_link import WorkerKVLink

            self.link = WorkerKVLink(self.cfg, self.bus.nc, i, self._loop, self.kv)
            await self.link.start()
            self.spawn(self.link.run(self.cfg.heartbeat_interval_s))
            await self.bus.subscribe(s.worker_handoff(i), Handoff, self.split.on_handoff, concurrent=False,
                                     endpoint="handoff")
            await self.bus.subscribe(s.balancer_worker_lost, WorkerLost, self.split.on_worker_lost, concurrent=False,
                                     endpoint="worker_lost")
        self._generate_sub = await self.bus.subscribe(s.worker_generate(i), GenerateRequest, self.generate,
                                                      concurrent=False, endpoint="generate")
        await self.bus.subscribe(s.worker_abort(i), AbortRequest, self.abort, concurrent=False, endpoint="abort")
        await self.bus.subscribe(s.worker_abort_all, AbortRequest, self.abort, concurrent=False,
                                 endpoint="abort_all")

    async def teardown(self) -> None:
        if self._generate_sub is not None:
            await self._generate_sub.unsubscribe()  # the balancer now gets no-responders here
        for rid, a in list(self._active.items()):
            if not a.started:
                self._fail(rid, ErrorCode.DRAINING, "worker draining", retryable=True, counter="handed_back")
        deadline = time.monotonic() + self.cfg.drain_grace_s
        while self._active and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            self._fail(rid, ErrorCode.DRAINING, "worker stopped", retryable=True, counter="handed_back")
        if self._loop is not None:
            await asyncio.to_thread(self._loop.stop)
        await self._outbox.put(None)
        await self._outbox_drained()
        if self.link is not None:
            await self.link.close()

    async def _outbox_drained(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout  # bounded: a dead NATS must not hang the shutdown
        while not self._outbox.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ---- endpoints -------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, _: Msg) -> GenerateAccepted:
        if self.draining or not self.ready:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"{self.instance_id} is not taking requests", retry_after=1)
        if req.model != self.served_model:
            raise ServiceError(ErrorCode.NOT_FOUND, f"worker serves {self.served_model!r}", param="model")
        accepted = GenerateAccepted(request_id=req.request_id, worker_id=self.instance_id, attempt=req.attempt)
        if req.request_id in self._active:
            return accepted  # a retried delivery of the same request: idempotent
        if self.queued() >= self.cfg.max_queued:
            self.counters["rejected_overloaded"] += 1
            self._m_requests.labels("overloaded").inc()
            raise ServiceError(ErrorCode.OVERLOADED, f"{self.instance_id} queue is full", retry_after=1)
        self.split.check(req)  # stage prefill / decode: ServiceError when it cannot run here
        params = [choice_params(req.params, i, self.toy) for i in range(req.params.n)]  # ValueError -> 400
        a = _Active(req, self.tracing.inject(), time.monotonic(), seq=[0] * req.params.n,
                    open=set(range(req.params.n)), params=params)
        self._active[req.request_id] = a
        if req.stage == "decode":
            a.seq[0] = 1  # the prefill worker sent chunk 0 (the first token)
            self.spawn(self.split.start_decode(a))
        elif self.link is not None and self.link.broker is not None:
            self.spawn(self._fetch_then_add(a))  # the broker's tiers may hold this prompt's prefix
        else:
            self.quarantine.submit(a)
        self.counters["accepted"] += 1
        self._m_queue.set(self.queued())
        return accepted

    def _add(self, a: _Active) -> None:
        prefill = a.req.stage == "prefill"
        for i, p in enumerate(a.params):
            self._loop.add(f"{a.req.request_id}#{i}", a.req.prompt_token_ids, p, prefill_only=prefill)

    async def _fetch_then_add(self, a: _Active) -> None:
        try:
            await self.link.fetch(a.req.prompt_token_ids)
        except Exception:  # the tiers are an optimisation: recompute instead
            log.warning("KV tier fetch for %s failed", a.req.request_id, exc_info=True)
        if self._active.get(a.req.request_id) is a:  # not aborted meanwhile
            self.quarantine.submit(a)

    async def abort(self, req: AbortRequest, _: Msg) -> None:
        a = self._active.pop(req.request_id, None)
        if a is None:
            return
        self.quarantine.done(req.request_id)
        for sub in a.sub_ids():
            self._loop.abort(sub)
        self.counters["aborted"] += 1
        self._m_requests.labels("aborted").inc()

    # ---- engine side -----------------------------------------------------------------------
    def _on_outputs(self, outputs: list[Any], failed: list[AddFailed], prefilled: list[Prefilled] = ()) -> None:
        for f in failed:
            rid = f.sub_id.rsplit("#", 1)[0]
            self._fail(rid, ErrorCode.BAD_REQUEST, f.error, retryable=False, counter="failed")
        tok = self._loop.tokenizer
        for out in outputs:
            rid, _, idx = out.request_id.rpartition("#")
            a = self._active.get(rid)
            if a is None or int(idx) not in a.open:
                continue  # aborted while the step ran
            i = int(idx)
            if getattr(out, "error", None):  # the engine failed this choice: the request fails whole
                code = ErrorCode.ENGINE_FAILED if out.retryable else ErrorCode.REQUEST_FAILED
                self._fail(rid, code, out.error, retryable=out.retryable, counter="failed")
                continue
            chunk = chunk_from_output(out, a.req, self.instance_id, i, a.seq[i], tok)
            if a.req.stage == "decode":
                chunk.num_cached_tokens = 0  # the prompt came from the prefill worker: its count stands
            elif a.req.stage == "prefill":
                a.first_token = chunk.token_ids[0] if chunk.token_ids else None
                if chunk.finished:
                    self.split.finished_at_first_token(a)
            a.seq[i] += 1
            if not a.started:
                a.started = True
                self._m_ttft.observe(time.monotonic() - a.accepted_at)
            self._m_tokens.inc(len(chunk.token_ids))
            if chunk.finished:
                a.open.discard(i)
                if not a.open:
                    del self._active[rid]
                    self.quarantine.done(rid)
                    self.counters["finished"] += 1
                    self._m_requests.labels("finished").inc()
                    self._beat_soon()
            self._outbox.put_nowait((a.req.reply_to, chunk, a.trace_headers))
        for p in prefilled:
            self.split.prefilled(p)
        self._m_queue.set(self.queued())

    def _beat_soon(self) -> None:
        """A finished request: tell the balancers now, not at the next beat, so its stale load
        does not push the next request (maybe one with this worker's cached prefix) elsewhere."""
        if self._beat_pending:
            return
        self._beat_pending = True

        async def beat() -> None:
            await asyncio.sleep(0.005)  # one beat for requests finishing together
            self._beat_pending = False
            await self.publish_heartbeat()
        self.spawn(beat())

    def _on_fatal(self, exc: BaseException) -> None:
        """The engine broke: its requests may run elsewhere (the frontend caps how many workers
        one request may break). A loop that rebuilds its engine comes back ready; one that gave
        up makes this process exit, so its supervisor restarts it."""
        rebuilt = self._loop is not None and self._loop.failed is None
        # Held requests never reached the broken engine: they run on the rebuilt one. Decided up
        # front: failing a request releases the next held one into the engine.
        lost = [rid for rid in self._active if not (rebuilt and self.quarantine.holds(rid))]
        for rid in lost:
            self._fail(rid, ErrorCode.ENGINE_FAILED, f"engine failed: {type(exc).__name__}: {exc}",
                       retryable=True, counter="failed")
        if self._loop is not None and self._loop.failed is not None:
            self.request_exit(f"engine failed for good: {type(exc).__name__}: {exc}")

    def _fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str) -> None:
        a = self._active.pop(rid, None)
        if a is None:
            return
        self.quarantine.done(rid)
        if a.req.stage == "prefill":
            self.split.cancelled(a)
        if self._loop is not None and self._loop.failed is None:
            for sub in a.sub_ids():
                self._loop.abort(sub)
        self.counters[counter] += 1
        self._m_requests.labels(counter).inc()
        chunk = TokenChunk(request_id=rid, worker_id=self.instance_id, attempt=a.req.attempt, finished=True,
                           error=code.value, error_message=message, retryable=retryable)
        self._outbox.put_nowait((a.req.reply_to, chunk, a.trace_headers))

    async def _publisher(self) -> None:
        # One consumer keeps each request's chunks in order.
        while (item := await self._outbox.get()) is not None:
            subject, chunk, headers = item
            try:
                await self.bus.publish(subject, chunk, headers=headers)
            except Exception:
                log.warning("could not publish a chunk of %s", chunk.request_id, exc_info=True)
