"""WorkerService: runs one engine, takes routed requests, streams tokens to each request's inbox.

Lifecycle of a request: `generate.<id>` (admission: draining/unready -> unavailable, queue full ->
overloaded) -> GenerateAccepted reply -> TokenChunks on `reply_to` -> done, or `abort.<id>`.
The engine is any moebus.engine.port.EnginePort; n > 1 is one engine request whose choices the
engine fans out (sharing the prompt's KV), each output naming its choice (TokenChunk.index). On
drain (SIGTERM or the `drain` control subject), requests that have not produced a token are
handed back at once (retryable error chunk), the others get `drain_grace_s` to finish and are then
handed back too: the frontend moves them to another worker, which goes on from the tokens already
sent (migration). KV hand-offs under way finish before the process exits. Request counts live in
one place, the Prometheus counter (counters.py), which stats() reads. Every chunk sent is kept a
while (replay.py): a frontend that lost some in a bus blip asks for them again on `replay.<id>`.
Split requests (stage prefill / decode, see split.py) and the KV broker hooks (kv_link.py) are
only wired up for real engines; the toy engine runs aggregated requests only.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from moebus.devmodel.toy import TOY_MODEL
from moebus.engine.port import EngineOutput, EnginePort
from moebus.kv.hashing import BlockHashes
from moebus.platforms.cpu.core_share import CoreShare, torch_pacer
from moebus.platforms.cpu.cores import usable_cores
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import (
    AbortRequest,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    HandoffBeat,
    Heartbeat,
    KVInfo,
    Load,
    SamplingOptions,
    TokenChunk,
    TokenChunks,
    WorkerLost,
)
from moebus.shared.messages.generate import ReplayReply, ReplayRequest
from moebus.shared.service import Service

from .active import Active
from .chunk_meter import ChunkMeter
from .config import WorkerConfig
from .counters import RequestCounters
from .demand import Demand
from .engine_loop import AddFailed, EngineLoop, Prefilled, StepTiming
from .engine_metrics import EngineMetrics
from .engines import engine_params, make_engine
from .leases import FrontendLeases
from .outputs import StepChunks, chunk_from_output
from .quarantine import Quarantine
from .replay import ReplayBuffer
from .spans import RequestSpans
from .split import SplitStages
from .stats_log import StatsLine

if TYPE_CHECKING:
    from .kv_engine import EngineKV
    from .kv_link import WorkerKVLink

log = logging.getLogger(__name__)
# Aborts the stack sends itself (frontend.routing.generation, the balancer): nobody asks to replay the stream after them.
ROUTINE_ABORTS = frozenset({"client", "migrated", "orphan", "route timeout", "no prefill worker"})


class WorkerService(Service):
    name = "worker"

    def __init__(self, cfg: WorkerConfig, engine_factory: Callable[[], EnginePort] | None = None,
                 **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: WorkerConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self.toy = cfg.model == TOY_MODEL  # a factory may wrap the toy engine too (fault-injection tests)
        self._factory: Callable[[], EnginePort] = engine_factory or (lambda: make_engine(cfg))
        self.kv: EngineKV | None = None  # real engines: engine-thread KV hooks
        self.link: WorkerKVLink | None = None  # transports, broker index and tiers
        self.cores: CoreShare | None = None  # co-located workers sharing the cores (cfg.core_share_dir)
        self.split = SplitStages(self, cfg.handoff_beat_s, cfg.handoff_lost_s)
        self.quarantine = Quarantine(self._add)  # suspects (their engine broke before) run alone
        self._active: dict[str, Active] = {}
        # (subject, encoded message, headers, what it is: for a failed publish's log line)
        self._outbox: asyncio.Queue[tuple[str, bytes, dict[str, str], str] | None] = asyncio.Queue()
        self._queued = self._published = 0  # outbox items put / published (first-token hand-off)
        self.replay = ReplayBuffer(cfg.replay_max_bytes, cfg.replay_grace_s)
        # a dead frontend's requests are aborted; one across a partition keeps them (partition_grace_s)
        self.leases = FrontendLeases(cfg.frontend_lease_s, self.cluster_view, cfg.partition_grace_s)
        self._loop: EngineLoop | None = None
        self._generate_sub: Subscription | None = None
        m = self.metrics
        self.request_counts = RequestCounters(m)
        self._m_queue = m.gauge("queued_requests", "Requests waiting for their first token")
        self.engine_metrics = EngineMetrics(m, self.served_model, self.instance_id, self.load)  # moebus:*
        self.demand = Demand(cfg.latency_window_s)  # for the planner, in each heartbeat
        self.meter = ChunkMeter(m, self.engine_metrics, self.demand)

    # ---- state -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._loop is not None and self._loop.ready.is_set() and self._loop.failed is None

    @property
    def healthy(self) -> bool:
        return self._loop is None or (self._loop.failed is None and self._loop.alive)

    def model(self) -> str | None:
        return self.served_model

    @property
    def counters(self) -> dict[str, int]:
        """Request counts by outcome (read from the Prometheus counter)."""
        return self.request_counts.snapshot()

    def queued(self) -> int:
        return sum(1 for a in self._active.values() if not a.started)

    def load(self) -> Load:
        s = self._loop.stats if self._loop else {}
        return Load(num_running=int(s.get("num_running", 0)), num_waiting=self.queued(),
                    max_waiting=self.cfg.max_queued, kv_blocks_free=int(s.get("kv_blocks_free", 0)),
                    kv_blocks_total=int(s.get("kv_blocks_total", 0)),
                    core_group=self.cores.group if self.cores else "",
                    pack_rows=self.cfg.pack_rows if self.cores else 0,
                    prefix_cache_queries_total=self.engine_metrics.queries_total,
                    prefix_cache_hits_total=self.engine_metrics.hits_total, **self.demand.fields())

    def stats(self) -> dict[str, Any]:
        engine = dict(self._loop.stats) if self._loop else {}
        kv = {**self.link.counters, **(self.kv.counters if self.kv is not None else {}),
              "handoffs_lost": self.split.lost} if self.link is not None else {}
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
        corrupt = self.metrics.counter("kv_blocks_corrupt_total", "KV blocks that failed their checksum "
                                       "(dropped and recomputed, never used)", ["tier"])
        if not self.toy:
            from .kv_engine import EngineKV  # torch lives behind this import

            self.kv = EngineKV(self.cfg.kv_cpu_bytes, on_corrupt=lambda tier: corrupt.labels(tier).inc())
        pace = None
        if self.cfg.core_share_dir and not self.toy:
            self.cores = CoreShare(self.cfg.core_share_dir, self.instance_id, self.cfg.torch_threads or usable_cores())
            pace = torch_pacer(self.cores)
        self._loop = EngineLoop(self._factory, asyncio.get_running_loop(), self._on_outputs, self._on_fatal,
                                on_ready=lambda: self.spawn(self.publish_heartbeat()),  # be routable at once
                                kv=self.kv, max_restarts=self.cfg.engine_restarts,
                                restart_backoff_s=self.cfg.engine_restart_backoff_s,
                                warmup=self._warm_up if self.cfg.warmup else None, nice=self.cfg.engine_nice,
                                handoff=lambda sent: self.spawn(self._handed_off(sent)),
                                handoff_s=self.cfg.first_token_handoff_ms / 1000,
                                hold_s=self.cfg.first_token_hold_ms / 1000,
                                admit_s=self.cfg.admit_handoff_ms / 1000, pace=pace)
        self._loop.start()
        self.spawn(self._publisher())
        if self.cfg.stats_log_interval_s:
            self.spawn(StatsLine(self.load, self.engine_metrics).run(self.cfg.stats_log_interval_s))
        s, i = self.subjects, self.instance_id
        if self.kv is not None:
            from .kv_link import WorkerKVLink

            self.link = WorkerKVLink(self.cfg, self.bus.nc, i, self._loop, self.kv,
                                     on_corrupt=lambda n: corrupt.labels("transfer").inc(n), metrics=self.metrics,
                                     tracing=self.tracing)
            await self.link.start()
            self.spawn(self.link.run(self.cfg.heartbeat_interval_s))
            await self.bus.subscribe(s.worker_handoff(i), Handoff, self.split.on_handoff, concurrent=False,
                                     endpoint="handoff")
            await self.bus.subscribe(s.balancer_worker_lost, WorkerLost, self.split.on_worker_lost, concurrent=False,
                                     endpoint="worker_lost")
            await self.bus.subscribe(s.worker_handoff_beat(i), HandoffBeat, self.split.on_beat, concurrent=False,
                                     endpoint="handoff_beat", traced=False)
            self.spawn(self.split.run_beats())
        self._generate_sub = await self.bus.subscribe(s.worker_generate(i), GenerateRequest, self.generate,
                                                      concurrent=False, endpoint="generate")
        await self.bus.subscribe(s.worker_abort(i), AbortRequest, self.abort, concurrent=False, endpoint="abort")
        await self.bus.subscribe(s.worker_abort_all, AbortRequest, self.abort, concurrent=False,
                                 endpoint="abort_all")
        await self.bus.subscribe(s.worker_replay(i), ReplayRequest, self.on_replay, concurrent=False,
                                 endpoint="replay")
        await self.bus.subscribe(s.heartbeat_all("frontend"), Heartbeat, self._on_frontend_beat, concurrent=False,
                                 endpoint="frontend_heartbeat", traced=False)
        self.spawn(self.leases.run(self.bus, self.subjects, lambda: [a.req for a in self._active.values()],
                                   self._frontend_lost, max(self.cfg.heartbeat_interval_s, 0.5)))

    async def _frontend_lost(self, rid: str) -> None:
        # Ended with a retryable error rather than silently: were the frontend alive after all (its
        # beats cut off from us alone), it moves the request on instead of waiting for it.
        self.fail(rid, ErrorCode.UNAVAILABLE, "its frontend is gone (lease lost)", retryable=True, counter="aborted")

    async def _on_frontend_beat(self, beat: Heartbeat, _: Msg) -> None:
        self.leases.observe(beat, time.monotonic())

    def _warm_up(self, engine: EnginePort) -> None:
        """One short greedy generation, on the engine thread before the engine is ready (engine_loop.py)."""
        try:
            prompt = list(engine.tokenizer.encode("Hello"))[:8] or [0]
        except Exception:  # a tokenizer without encode: any in-vocabulary ids do
            prompt = [0, 1, 2]
        rid = f"warmup-{self.incarnation}"
        engine.add_request(rid, prompt, engine_params(SamplingOptions(max_tokens=2, temperature=0.0,
                                                                      ignore_eos=True), self.toy))
        deadline = time.monotonic() + self.cfg.warmup_timeout_s
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                engine.abort_request(rid)
                raise TimeoutError(f"the warm-up generation took over {self.cfg.warmup_timeout_s:g}s")
            engine.step()

    async def teardown(self) -> None:
        if self._generate_sub is not None:
            await self._generate_sub.unsubscribe()  # the balancer now gets no-responders here
        for rid, a in list(self._active.items()):
            if not a.started:
                self.fail(rid, ErrorCode.DRAINING, "worker draining", retryable=True, counter="handed_back")
        deadline = time.monotonic() + self.cfg.drain_grace_s
        while self._active and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        for rid in list(self._active):  # the frontend moves them on from the tokens they have
            self.fail(rid, ErrorCode.DRAINING, "worker stopped", retryable=True, counter="handed_back")
        await self.split.flush(deadline - time.monotonic())
        if self._loop is not None:
            await asyncio.to_thread(self._loop.stop)
        if self.cores is not None:
            self.cores.close()
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
        self.cfg.limits.check(req)  # BAD_REQUEST past the frontend's bounds: whoever sent it (shared/limits.py)
        if req.request_id in self._active:
            return self._accepted(req)  # a retried delivery of the same request: idempotent
        if self.queued() >= self.cfg.max_queued:
            self.request_counts.inc("rejected_overloaded")
            raise ServiceError(ErrorCode.OVERLOADED, f"{self.instance_id} queue is full", retry_after=1)
        self.split.check(req)  # stage prefill / decode: ServiceError when it cannot run here
        params = engine_params(req.params, self.toy)  # ValueError -> 400
        a = Active(req, {}, time.monotonic(), params, seq=[0] * req.params.n,
                   open={c.index for c in req.resume} if req.resume else set(range(req.params.n)))
        self._active[req.request_id] = a
        accepted_ns = time.time_ns()
        if req.stage == "decode":
            a.seq[0] = 1  # the prefill worker sent chunk 0 (the first token)
            self.spawn(self.split.start_decode(a))
        elif self.link is not None and self.link.broker is not None:
            self.spawn(self._fetch_then_add(a))  # the broker's tiers may hold this prompt's prefix
        else:  # into the engine first: the rest here runs while an idle engine starts on it
            self.quarantine.submit(a)
        # (before this returns, so before any of its chunks: they come through this loop)
        a.trace_headers = self.tracing.inject()
        a.spans = RequestSpans.begin(self.tracing, req, self.instance_id, accepted_ns)  # None unless traced
        self.replay.open(req.request_id, req.attempt)
        if req.frontend_id:
            self.leases.hold((req.frontend_id, req.frontend_incarnation), time.monotonic())
        self.request_counts.inc("accepted")
        self.demand.accepted(len(req.prompt_token_ids))
        self._m_queue.set(self.queued())
        return self._accepted(req)

    def _accepted(self, req: GenerateRequest) -> GenerateAccepted:
        return GenerateAccepted(request_id=req.request_id, worker_id=self.instance_id, attempt=req.attempt)

    def _add(self, a: Active) -> None:
        resume = {c.index: c.token_ids for c in a.req.resume} if a.req.resume else None
        hashes = BlockHashes(a.req.block_hash_space, a.req.block_hashes) if a.req.block_hashes else None
        self._loop.add(a.req.request_id, a.req.prompt_token_ids, a.params, prefill_only=a.req.stage == "prefill",
                       resume=resume, images=a.req.images, priority=a.req.priority, owner=a.req.owner,
                       block_hashes=hashes)

    async def _fetch_then_add(self, a: Active) -> None:
        try:
            await self.link.fetch(a.req)
        except Exception:  # the tiers are an optimisation: recompute instead
            log.warning("KV tier fetch for %s failed", a.req.request_id, exc_info=True)
        if self._active.get(a.req.request_id) is a:  # not aborted meanwhile
            self.quarantine.submit(a)

    async def abort(self, req: AbortRequest, _: Msg) -> None:
        """Stop the request whatever it is doing (queued, fetching KV, prefilling, decoding) and end
        its stream with a final error chunk: an abort its frontend did not send (an operator, a
        second frontend) must not leave the client waiting. Its own frontend ignores that chunk
        (it forgot the request, or moved it to a newer attempt). An abort of an older attempt than
        the one running here is stale: that attempt already ended here or never ran here."""
        a = self._active.get(req.request_id)
        if a is not None and req.attempt is not None and req.attempt < a.req.attempt:
            return
        self.fail(req.request_id, ErrorCode.ABORTED, f"the request was aborted ({req.reason})", retryable=False,
                  counter="aborted")
        if req.reason in ROUTINE_ABORTS:  # its frontend or the balancer gave up on it here: nobody replays it
            self.replay.drop(req.request_id)

    # ---- engine side -----------------------------------------------------------------------
    def _on_outputs(self, outputs: Sequence[EngineOutput], failed: list[AddFailed],
                    prefilled: list[Prefilled] = (), step: StepTiming | None = None) -> None:
        for f in failed:  # refused by the engine: for what it asks (a 400), or for now (busy)
            self.fail(f.request_id, ErrorCode.OVERLOADED if f.retryable else ErrorCode.BAD_REQUEST, f.error,
                      retryable=f.retryable, counter="failed", param=f.param)
        tok = self._loop.tokenizer
        batches = StepChunks()  # this step's chunks, one message per frontend
        direct: list[tuple[str, bytes, dict[str, str], str]] = []  # chunks for a reply subject of their own
        finished = False
        for out in outputs:
            rid, i = out.request_id, out.index
            a = self._active.get(rid)
            if a is None or i not in a.open:
                continue  # aborted while the step ran
            if out.error:  # the engine failed this choice: the request fails whole
                code = ErrorCode.ENGINE_FAILED if out.retryable else \
                    ErrorCode.BAD_REQUEST if out.error_param else ErrorCode.REQUEST_FAILED
                self.fail(rid, code, out.error, retryable=out.retryable, counter="failed", param=out.error_param)
                continue
            chunk = chunk_from_output(out, a.req, self.instance_id, i, a.seq[i], tok)
            if a.req.stage == "decode":
                chunk.num_cached_tokens = 0  # the prompt came from the prefill worker: its count stands
            elif a.req.stage == "prefill":
                a.first_token = chunk.token_ids[0] if chunk.token_ids else None
                if chunk.finished:
                    self.split.finished_at_first_token(a)
            a.seq[i] += 1
            if a.req.suspect:
                a.sent.setdefault(i, []).extend(chunk.token_ids)
            if a.spans is not None:
                a.spans.chunk(chunk, step)
            now = time.monotonic()
            self.meter.sent(chunk, first=not a.started, since_s=now - (a.last_chunk_at if a.started else a.accepted_at),
                            prefilled_here=a.req.stage != "decode" and not a.req.resume, now=now)
            a.started, a.last_chunk_at = True, now
            if chunk.finished:
                a.open.discard(i)
                if not a.open:
                    self.release(rid, "finished")
                    self.meter.finished(chunk.finish_reason)
                    finished = True
            data = chunk.encode()
            self.replay.record(chunk, data)
            if (fid := self._frontend_of(a.req)) is not None:
                batches.add(fid, data)
            else:
                direct.append((a.req.reply_to, data, a.trace_headers, chunk.request_id))
        if finished:
            # A request finished: the balancers hear of it before its last chunk leaves (the same
            # outbox, the same connection), so a client's next request, maybe with this worker's
            # cached prefix, is never routed on the load of the one it just got the end of.
            self._enqueue(self.subjects.heartbeat(self.name, self.instance_id), self.heartbeat().encode(), {},
                          "a heartbeat")
        for item in direct:
            self._enqueue(*item)
        for fid, data in batches.messages():
            self._enqueue(self.subjects.frontend_chunks(fid), data, {}, f"a step's chunks for {fid}")
        for p in prefilled:
            if (a := self._active.get(p.request_id)) is not None and a.spans is not None:
                a.spans.extracted(p)
            self.split.prefilled(p)
        self._m_queue.set(self.queued())

    def _on_fatal(self, exc: BaseException) -> None:
        """The engine broke: its requests may run elsewhere (the frontend caps how many workers
        one request may break). A loop that rebuilds its engine comes back ready; one that gave
        up makes this process exit, so its supervisor restarts it."""
        rebuilt = self._loop is not None and self._loop.failed is None
        # Held requests never reached the broken engine: they run on the rebuilt one. A batch of
        # suspects is split and rerun here (quarantine.py); one that broke it alone fails. Decided
        # up front: failing a request releases the next held one into the engine.
        batch = [self._active[r] for r in self.quarantine.batch if r in self._active]
        rerun = [a for a in batch if a.req.stage == "aggregated"] if rebuilt and len(batch) > 1 else []
        for a in rerun:
            a.req = a.resumed_here()
            a.sent.clear()
            # An add still queued when the engine broke reaches the rebuilt one: drop it, or the rerun's
            # add is a duplicate (seen under load in CI: "duplicate request id")
            self._loop.abort(a.req.request_id)
        kept = {a.req.request_id for a in rerun}
        lost = [rid for rid in self._active if rid not in kept and not (rebuilt and self.quarantine.holds(rid))]
        if rerun:
            log.warning("engine broke with %d suspects: rerunning them here in two halves", len(rerun))
            self.quarantine.bisect(rerun)
        for rid in lost:
            self.fail(rid, ErrorCode.ENGINE_FAILED, f"engine failed: {type(exc).__name__}: {exc}",
                       retryable=True, counter="failed")
        if self._loop is not None and self._loop.failed is not None:
            self.request_exit(f"engine failed for good: {type(exc).__name__}: {exc}")

    # ---- the surface split.py works through ---------------------------------------------------
    def active(self, rid: str) -> Active | None:
        return self._active.get(rid)

    def active_requests(self) -> list[Active]:
        return list(self._active.values())

    def release(self, rid: str, outcome: str) -> Active | None:
        """The request leaves this worker with `outcome` (finished, handed_off) and no error chunk."""
        a = self._active.pop(rid, None)
        if a is not None:
            self.quarantine.done(rid)
            self.request_counts.inc(outcome)
            if a.spans is not None:
                a.spans.end(outcome)
            self.replay.finish(rid)
        return a

    def fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str,
             blame: str | None = None, param: str | None = None) -> None:
        """End the request with an error chunk (counted as `counter`); its engine request is aborted.
        blame: another worker at fault (the frontend excludes it rather than this one); param: the
        request field at fault (the error's param)."""
        a = self._active.pop(rid, None)
        if a is None:
            return
        self.quarantine.done(rid)
        if a.spans is not None:
            a.spans.end(counter, code.value)
        if a.req.stage == "prefill":
            self.split.cancelled(a)
        if self._loop is not None and self._loop.failed is None:
            self._loop.abort(rid)
        self.request_counts.inc(counter)
        chunk = TokenChunk(request_id=rid, worker_id=self.instance_id, attempt=a.req.attempt, finished=True,
                           error=code.value, error_message=message, retryable=retryable, failed_worker=blame,
                           error_param=param)
        self.send(a.req.reply_to, chunk, a.trace_headers, a.req)
        self.replay.finish(rid)

    def send(self, subject: str, message: TokenChunk | Handoff, headers: dict[str, str],
             req: GenerateRequest | None = None) -> None:
        """Publish in order after everything sent before (one publisher drains the outbox); a
        chunk is kept for replay from now on. A chunk of `req` for its frontend's stream goes the
        way of the step's chunks (frontend_chunks): one subscription there keeps its order."""
        data = message.encode()
        if isinstance(message, TokenChunk):
            self.replay.record(message, data)
            if req is not None and req.reply_to == subject and (fid := self._frontend_of(req)) is not None:
                subject, data = self.subjects.frontend_chunks(fid), TokenChunks.join([data])
        self._enqueue(subject, data, headers, message.request_id)

    def _frontend_of(self, req: GenerateRequest) -> str | None:
        """The frontend whose stream subject the request names (its chunks go in that frontend's
        step messages); None: a reply subject of the sender's own (tests, tools)."""
        fid = req.frontend_id
        return fid if fid and req.reply_to == self.subjects.frontend_stream(fid, req.request_id) else None

    def _enqueue(self, subject: str, data: bytes, headers: dict[str, str], what: str) -> None:
        self._outbox.put_nowait((subject, data, headers, what))
        self._queued += 1

    async def on_replay(self, req: ReplayRequest, _: Msg) -> ReplayReply:
        return self.replay.replay(req)

    def inject(self, a: Active, first_token: int, payload: Any) -> None:
        """A decode half: admit the request prefilled elsewhere (payload None: recompute its prompt)."""
        if a.spans is not None:
            a.spans.injecting()
        self._loop.inject(a.req.request_id, a.req.prompt_token_ids, first_token, a.params, payload, a.req.images)

    async def _handed_off(self, sent: threading.Event, rounds: int = 50) -> None:
        """Set `sent` once everything in the outbox now has been published and nats-py's flusher
        has had a turn to write it (a bounded number of loop turns: the engine thread waits on it)."""
        target = self._queued
        for _ in range(rounds):
            if self._published >= target:
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the flusher task writes what publish buffered
        sent.set()

    async def _publisher(self) -> None:
        # One consumer keeps each request's chunks in order.
        while (item := await self._outbox.get()) is not None:
            subject, data, headers, what = item
            try:
                await self.bus.publish(subject, data, headers=headers)
            except Exception:  # cut off with nats-py's buffer full: the frontend asks the replay buffer later
                log.log(logging.WARNING if self.bus.connected else logging.DEBUG, "could not publish %s", what,
                        exc_info=True)
            self._published += 1
