"""The two halves of a prefill/decode split request on a worker.

Prefill (stage "prefill"): the engine runs the request to its first token, which streams to the
client as chunk 0; the engine thread then extracts the prompt's KV and aborts the request
(EngineLoop prefill_only), and this side pushes the KV to the decode worker, then a Handoff
with the first token (after the KV, so the decode worker knows whether to wait for it).
Decode (stage "decode"): wait for the Handoff, take the KV (none or broken: recompute the
prompt, same tokens, only slower), inject the request with its first token and stream from
chunk 1 on. A prefill worker that never hands off makes this a retryable failure.

Lost hand-offs are found in seconds, not at the spec's timeout: a prefill worker names the split
requests it holds (queued, prefilling, handing over) to their decode workers every
`handoff_beat_s` (HandoffBeat, on the control connection). A decode half whose transfer goes
unnamed for `handoff_lost_s` (3x that before the first beat: the balancer may still be trying
prefill workers) fails as the prefill worker's fault, retryable, so the frontend moves the
request on (migration: same tokens under greedy). Silence while this worker was itself cut off
from the bus is no evidence (Bus.evidence_since).

The worker is asked through `SplitHost`, its small public surface (WorkerService satisfies it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.msg import Msg

from moebus.shared.bus import Bus
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateRequest, Handoff, HandoffBeat, TokenChunk, WorkerLost
from moebus.shared.subjects import Subjects

from .active import Active
from .engine_loop import Prefilled
from .spans import nbytes, record

if TYPE_CHECKING:
    from .kv_link import WorkerKVLink

log = logging.getLogger(__name__)


class SplitHost(Protocol):
    instance_id: str
    subjects: Subjects
    link: WorkerKVLink | None  # None: this worker's engine moves no KV
    bus: Bus

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    def active(self, rid: str) -> Active | None: ...

    def active_requests(self) -> list[Active]: ...

    def release(self, rid: str, outcome: str) -> Active | None: ...

    def fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str,
             blame: str | None = None) -> None: ...

    def send(self, subject: str, message: TokenChunk | Handoff, headers: dict[str, str]) -> None: ...

    def inject(self, a: Active, first_token: int, payload: Any) -> None: ...


class SplitStages:
    def __init__(self, host: SplitHost, beat_s: float = 1.0, lost_s: float = 6.0) -> None:
        self.host = host
        self.beat_s, self.lost_s = beat_s, lost_s
        self._handoffs: dict[str, asyncio.Future[Handoff]] = {}  # transfer id -> the decode side's wait
        self._named: dict[str, float] = {}  # transfer id -> when a beat last named it (decode side)
        self._sending: dict[asyncio.Task, Active] = {}  # prefill side: KV pushes and hand-offs under way
        self.lost = 0  # decode halves given up because their prefill half went silent

    def check(self, req: GenerateRequest) -> None:
        if req.stage == "aggregated":
            return
        link = self.host.link
        if link is None:
            raise ServiceError(ErrorCode.UNAVAILABLE, "this worker's engine cannot split requests")
        if req.kv_transfer is None or req.params.n != 1 or req.resume:
            raise ServiceError(ErrorCode.BAD_REQUEST, "split requests need kv_transfer, n == 1 and no resume")
        if req.stage == "decode" and link.receiver is None:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"{self.host.instance_id} does not receive KV")

    # ---- prefill side ----------------------------------------------------------------------
    def prefilled(self, p: Prefilled) -> None:
        """Engine thread extracted (and aborted) the request after its first token."""
        a = self.host.active(p.request_id)
        if a is None or a.req.stage != "prefill":
            return  # aborted meanwhile (maybe already replaced by a later attempt)
        self.host.release(p.request_id, "handed_off")
        task = self.host.spawn(self._hand_over(a, p.payload))
        self._sending[task] = a
        task.add_done_callback(lambda t: self._sending.pop(t, None))

    async def flush(self, timeout_s: float) -> None:
        """Drain: let the hand-overs under way finish (a decode worker is waiting for each)."""
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=max(timeout_s, 2.0))  # even past the grace

    async def run_beats(self) -> None:
        """Prefill side, in the background: name the split requests held to their decode workers."""
        while True:
            await asyncio.sleep(self.beat_s)
            held: dict[str, list[str]] = defaultdict(list)
            for a in [*self.host.active_requests(), *self._sending.values()]:
                if a.req.stage == "prefill" and a.req.kv_transfer is not None:
                    held[a.req.kv_transfer.decode_worker].append(a.req.kv_transfer.transfer_id)
            if not held or self.host.link is None or not self.host.bus.connected:
                continue
            for decode_worker, tids in held.items():
                try:
                    await self.host.link.beat(decode_worker, tids)
                except Exception:  # the next beat tries again
                    log.debug("hand-off beat to %s failed", decode_worker, exc_info=True)

    async def on_beat(self, beat: HandoffBeat, _: Msg) -> None:
        now = time.monotonic()
        for tid in beat.transfer_ids:
            if tid in self._handoffs:
                self._named[tid] = now

    async def _hand_over(self, a: Active, payload: Any) -> None:
        spec, started = a.req.kv_transfer, time.time_ns()
        sent = await self.host.link.send(payload, spec)
        record(a, "kv.send", started, **{"moebus.kv.bytes": nbytes(payload), "moebus.kv.ok": sent,
                                         "moebus.decode_worker_id": spec.decode_worker})
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt, first_token=a.first_token,
                                 kv_sent=sent))

    def finished_at_first_token(self, a: Active) -> None:
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt, first_token=a.first_token,
                                 finished=True))

    def cancelled(self, a: Active) -> None:
        """The prefill half failed: let the decode worker drop its half now, not at its timeout."""
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt))

    def _handoff(self, a: Active, h: Handoff) -> None:
        # Through the outbox: after the first token's chunk, in order.
        self.host.send(self.host.subjects.worker_handoff(a.req.kv_transfer.decode_worker), h, a.trace_headers)

    # ---- decode side -----------------------------------------------------------------------
    async def on_worker_lost(self, event: WorkerLost, _: Msg) -> None:
        """A prefill worker died: its pending halves will never be handed over."""
        for a in self.host.active_requests():
            spec = a.req.kv_transfer
            if a.req.stage == "decode" and spec.prefill_worker == event.worker_id and spec.transfer_id in self._handoffs:
                fut = self._handoffs[spec.transfer_id]
                if not fut.done():
                    fut.set_result(Handoff(request_id=a.req.request_id, attempt=a.req.attempt))

    async def on_handoff(self, h: Handoff, _: Msg) -> None:
        fut = self._handoffs.get(f"{h.request_id}#{h.attempt}")
        if fut is not None and not fut.done():
            fut.set_result(h)

    async def start_decode(self, a: Active) -> None:
        spec, rid, host = a.req.kv_transfer, a.req.request_id, self.host
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._handoffs[spec.transfer_id] = fut
        waited = time.time_ns()
        try:
            h, why = await self._wait_handoff(spec.transfer_id, fut, spec.timeout_s)
        finally:
            self._handoffs.pop(spec.transfer_id, None)
            self._named.pop(spec.transfer_id, None)
        record(a, "kv.handoff_wait", waited, **{"moebus.prefill_worker_id": spec.prefill_worker,
                                                "moebus.handed_over": h is not None and h.first_token is not None})
        if host.active(rid) is not a:
            return  # aborted while waiting
        if h is None or h.first_token is None:
            host.fail(rid, ErrorCode.WORKER_LOST, f"the prefill stage ({spec.prefill_worker}) did not hand over{why}",
                      retryable=True, counter="failed", blame=spec.prefill_worker)
            return
        if h.finished:  # the prefill worker's chunk already finished the request
            host.release(rid, "finished")
            return
        # The KV went out before the hand-off: it is here already, or (shm) about to be readable.
        wait = min(spec.timeout_s, self.lost_s)
        received = time.time_ns()
        payload = await host.link.receive(spec.transfer_id, wait) if h.kv_sent else None
        record(a, "kv.receive", received, **{"moebus.kv.bytes": nbytes(payload), "moebus.kv.sent": h.kv_sent,
                                             "moebus.kv.ok": payload is not None})
        if host.active(rid) is a:
            host.inject(a, h.first_token, payload)

    async def _wait_handoff(self, tid: str, fut: asyncio.Future[Handoff],
                            timeout_s: float) -> tuple[Handoff | None, str]:
        """The hand-off, or (None, why) once the prefill half is silent past lost_s (or timeout_s)."""
        started = time.monotonic()
        step = max(0.05, min(0.5, self.lost_s / 4))
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), step), ""
            except TimeoutError:
                pass
            now = time.monotonic()
            if now - started > timeout_s:
                return None, f" within {timeout_s:g}s"
            named = self._named.get(tid)
            allowed = self.lost_s if named is not None else 3 * self.lost_s
            since = max(named if named is not None else started, self.host.bus.evidence_since)
            if now - since > allowed:
                self.lost += 1
                return None, f": no hand-off beat for {now - since:.1f}s"
