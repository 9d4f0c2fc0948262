"""WorkerService: runs one engine, takes routed requests, streams tokens to each request's inbox.

Lifecycle of a request: `generate.<id>` (admission: draining/unready -> unavailable, queue full ->
overloaded) -> GenerateAccepted reply -> TokenChunks on `reply_to` -> done, or `abort.<id>`.
n > 1 runs n engine requests ``<request_id>#<i>``. On drain, requests that have not produced a
token are handed back (retryable error chunk) so the frontend reruns them elsewhere.
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
from moebus.shared.messages import AbortRequest, GenerateAccepted, GenerateRequest, Load, TokenChunk
from moebus.shared.service import Service
from moebus.shared.toy_model import TOY_MODEL

from .config import WorkerConfig
from .engine_loop import AddFailed, EngineLoop
from .engines import choice_params, make_engine
from .outputs import chunk_from_output

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    req: GenerateRequest
    trace_headers: dict[str, str]  # the generate span's context, for every chunk of the stream
    accepted_at: float
    seq: list[int] = field(default_factory=list)
    open: set[int] = field(default_factory=set)  # choice indices not finished yet
    started: bool = False  # some token went out: no longer safe to hand back for a rerun

    def sub_ids(self) -> list[str]:
        return [f"{self.req.request_id}#{i}" for i in sorted(self.open)]


class WorkerService(Service):
    name = "worker"

    def __init__(self, cfg: WorkerConfig, engine_factory: Any = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: WorkerConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self._factory = engine_factory or (lambda: make_engine(cfg))
        self._active: dict[str, _Active] = {}
        self._outbox: asyncio.Queue[tuple[str, TokenChunk, dict[str, str]] | None] = asyncio.Queue()
        self._loop: EngineLoop | None = None
        self._generate_sub: Subscription | None = None
        self.counters = {"accepted": 0, "finished": 0, "aborted": 0, "rejected_overloaded": 0,
                         "handed_back": 0, "failed": 0}
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
        return {"engine": engine, "active_requests": len(self._active), "queued": self.queued(), **self.counters}

    # ---- lifecycle -------------------------------------------------------------------------
    async def setup(self) -> None:
        self._loop = EngineLoop(self._factory, asyncio.get_running_loop(), self._on_outputs, self._on_fatal,
                                on_ready=lambda: self.spawn(self.publish_heartbeat()))  # be routable at once
        self._loop.start()
        self.spawn(self._publisher())
        s, i = self.subjects, self.instance_id
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
                self._fail(rid, ErrorCode.WORKER_LOST, "worker draining", retryable=True, counter="handed_back")
        deadline = time.monotonic() + self.cfg.drain_grace_s
        while self._active and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            self._fail(rid, ErrorCode.WORKER_LOST, "worker stopped", retryable=True, counter="handed_back")
        if self._loop is not None:
            await asyncio.to_thread(self._loop.stop)
        await self._outbox.put(None)
        await self._outbox_drained()

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
        toy = self.cfg.model == TOY_MODEL
        params = [choice_params(req.params, i, toy) for i in range(req.params.n)]  # ValueError -> 400
        a = _Active(req, self.tracing.inject(), time.monotonic(), seq=[0] * req.params.n,
                    open=set(range(req.params.n)))
        self._active[req.request_id] = a
        for i, p in enumerate(params):
            self._loop.add(f"{req.request_id}#{i}", req.prompt_token_ids, p)
        self.counters["accepted"] += 1
        self._m_queue.set(self.queued())
        return accepted

    async def abort(self, req: AbortRequest, _: Msg) -> None:
        a = self._active.pop(req.request_id, None)
        if a is None:
            return
        for sub in a.sub_ids():
            self._loop.abort(sub)
        self.counters["aborted"] += 1
        self._m_requests.labels("aborted").inc()

    # ---- engine side -----------------------------------------------------------------------
    def _on_outputs(self, outputs: list[Any], failed: list[AddFailed]) -> None:
        for f in failed:
            rid = f.sub_id.rsplit("#", 1)[0]
            self._fail(rid, ErrorCode.BAD_REQUEST, f.error, retryable=False, counter="failed")
        tok = self._loop.engine.tokenizer
        for out in outputs:
            rid, _, idx = out.request_id.rpartition("#")
            a = self._active.get(rid)
            if a is None or int(idx) not in a.open:
                continue  # aborted while the step ran
            i = int(idx)
            chunk = chunk_from_output(out, a.req, self.instance_id, i, a.seq[i], tok)
            a.seq[i] += 1
            if not a.started:
                a.started = True
                self._m_ttft.observe(time.monotonic() - a.accepted_at)
            self._m_tokens.inc(len(chunk.token_ids))
            if chunk.finished:
                a.open.discard(i)
                if not a.open:
                    del self._active[rid]
                    self.counters["finished"] += 1
                    self._m_requests.labels("finished").inc()
            self._outbox.put_nowait((a.req.reply_to, chunk, a.trace_headers))
        self._m_queue.set(self.queued())

    def _on_fatal(self, exc: BaseException) -> None:
        for rid in list(self._active):
            self._fail(rid, ErrorCode.WORKER_LOST, f"engine failed: {exc}", retryable=True, counter="failed")

    def _fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str) -> None:
        a = self._active.pop(rid, None)
        if a is None:
            return
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
