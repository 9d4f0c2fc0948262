"""The two halves of a prefill/decode split request on a worker.

Prefill (stage "prefill"): the engine runs the request to its first token, which streams to the
client as chunk 0; the engine thread then extracts the prompt's KV and aborts the request
(EngineLoop prefill_only), and this side pushes the KV to the decode worker, then a Handoff
with the first token (after the KV, so the decode worker knows whether to wait for it).
Decode (stage "decode"): wait for the Handoff, take the KV (none or broken: recompute the
prompt, same tokens, only slower), inject the request with its first token and stream from
chunk 1 on. A prefill worker that never hands off makes this a retryable failure.

The worker is asked through `SplitHost`, its small public surface (WorkerService satisfies it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.msg import Msg

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateRequest, Handoff, TokenChunk, WorkerLost
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

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    def active(self, rid: str) -> Active | None: ...

    def active_requests(self) -> list[Active]: ...

    def release(self, rid: str, outcome: str) -> Active | None: ...

    def fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str,
             blame: str | None = None) -> None: ...

    def send(self, subject: str, message: TokenChunk | Handoff, headers: dict[str, str]) -> None: ...

    def inject(self, a: Active, first_token: int, payload: Any) -> None: ...


class SplitStages:
    def __init__(self, host: SplitHost) -> None:
        self.host = host
        self._handoffs: dict[str, asyncio.Future[Handoff]] = {}  # transfer id -> the decode side's wait
        self._sending: set[asyncio.Task] = set()  # prefill side: KV pushes and hand-offs under way

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
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def flush(self, timeout_s: float) -> None:
        """Drain: let the hand-overs under way finish (a decode worker is waiting for each)."""
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=max(timeout_s, 2.0))  # even past the grace

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
            h: Handoff | None = await asyncio.wait_for(fut, spec.timeout_s)
        except TimeoutError:
            h = None
        finally:
            self._handoffs.pop(spec.transfer_id, None)
        record(a, "kv.handoff_wait", waited, **{"moebus.prefill_worker_id": spec.prefill_worker,
                                                "moebus.handed_over": h is not None and h.first_token is not None})
        if host.active(rid) is not a:
            return  # aborted while waiting
        if h is None or h.first_token is None:
            host.fail(rid, ErrorCode.WORKER_LOST, f"the prefill stage ({spec.prefill_worker}) did not hand over",
                      retryable=True, counter="failed", blame=spec.prefill_worker)
            return
        if h.finished:  # the prefill worker's chunk already finished the request
            host.release(rid, "finished")
            return
        received = time.time_ns()
        payload = await host.link.receive(spec.transfer_id, spec.timeout_s) if h.kv_sent else None
        record(a, "kv.receive", received, **{"moebus.kv.bytes": nbytes(payload), "moebus.kv.sent": h.kv_sent,
                                             "moebus.kv.ok": payload is not None})
        if host.active(rid) is a:
            host.inject(a, h.first_token, payload)
