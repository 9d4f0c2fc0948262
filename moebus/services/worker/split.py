"""The two halves of a prefill/decode split request on a worker.

Prefill (stage "prefill"): the engine runs the request to its first token, which streams to the
client as chunk 0; the engine thread then extracts the prompt's KV and aborts the request
(EngineLoop prefill_only), and this side pushes the KV to the decode worker, then a Handoff
with the first token (after the KV, so the decode worker knows whether to wait for it).
Decode (stage "decode"): wait for the Handoff, take the KV (none or broken: recompute the
prompt, same tokens, only slower), inject the request with its first token and stream from
chunk 1 on. A prefill worker that never hands off makes this a retryable failure.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateRequest, Handoff, WorkerLost

from .engine_loop import Prefilled

if TYPE_CHECKING:
    from .service import WorkerService, _Active

log = logging.getLogger(__name__)


class SplitStages:
    def __init__(self, svc: WorkerService) -> None:
        self.svc = svc
        self._handoffs: dict[str, asyncio.Future[Handoff]] = {}  # transfer id -> the decode side's wait

    def check(self, req: GenerateRequest) -> None:
        if req.stage == "aggregated":
            return
        if self.svc.kv is None or self.svc.link is None:
            raise ServiceError(ErrorCode.UNAVAILABLE, "this worker's engine cannot split requests")
        if req.kv_transfer is None or req.params.n != 1:
            raise ServiceError(ErrorCode.BAD_REQUEST, "split requests need kv_transfer and n == 1")
        if req.stage == "decode" and self.svc.link.receiver is None:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"{self.svc.instance_id} does not receive KV")

    # ---- prefill side ----------------------------------------------------------------------
    def prefilled(self, p: Prefilled) -> None:
        """Engine thread extracted (and aborted) the request after its first token."""
        rid = p.sub_id.rsplit("#", 1)[0]
        a = self.svc._active.get(rid)
        if a is None or a.req.stage != "prefill":
            return  # aborted meanwhile (maybe already replaced by a later attempt)
        del self.svc._active[rid]
        self.svc.counters["handed_off"] += 1
        self.svc.spawn(self._hand_over(a, p.payload))

    async def _hand_over(self, a: _Active, payload: Any) -> None:
        spec = a.req.kv_transfer
        sent = await self.svc.link.send(payload, spec)
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt, first_token=a.first_token,
                                 kv_sent=sent))

    def finished_at_first_token(self, a: _Active) -> None:
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt, first_token=a.first_token,
                                 finished=True))

    def cancelled(self, a: _Active) -> None:
        """The prefill half failed: let the decode worker drop its half now, not at its timeout."""
        self._handoff(a, Handoff(request_id=a.req.request_id, attempt=a.req.attempt))

    def _handoff(self, a: _Active, h: Handoff) -> None:
        # Through the outbox: after the first token's chunk, in order.
        subject = self.svc.subjects.worker_handoff(a.req.kv_transfer.decode_worker)
        self.svc._outbox.put_nowait((subject, h, a.trace_headers))

    # ---- decode side -----------------------------------------------------------------------
    async def on_worker_lost(self, event: WorkerLost, _: Msg) -> None:
        """A prefill worker died: its pending halves will never be handed over."""
        for a in list(self.svc._active.values()):
            spec = a.req.kv_transfer
            if a.req.stage == "decode" and spec.prefill_worker == event.worker_id and spec.transfer_id in self._handoffs:
                fut = self._handoffs[spec.transfer_id]
                if not fut.done():
                    fut.set_result(Handoff(request_id=a.req.request_id, attempt=a.req.attempt))

    async def on_handoff(self, h: Handoff, _: Msg) -> None:
        fut = self._handoffs.get(f"{h.request_id}#{h.attempt}")
        if fut is not None and not fut.done():
            fut.set_result(h)

    async def start_decode(self, a: _Active) -> None:
        spec, rid, svc = a.req.kv_transfer, a.req.request_id, self.svc
        fut: asyncio.Future[Handoff] = asyncio.get_running_loop().create_future()
        self._handoffs[spec.transfer_id] = fut
        try:
            h: Handoff | None = await asyncio.wait_for(fut, spec.timeout_s)
        except TimeoutError:
            h = None
        finally:
            self._handoffs.pop(spec.transfer_id, None)
        if svc._active.get(rid) is not a:
            return  # aborted while waiting
        if h is None or h.first_token is None:
            svc._fail(rid, ErrorCode.WORKER_LOST, "the prefill stage did not hand over", retryable=True,
                      counter="failed")
            return
        if h.finished:  # the prefill worker's chunk already finished the request
            del svc._active[rid]
            svc.counters["finished"] += 1
            return
        payload = await svc.link.receive(spec.transfer_id, spec.timeout_s) if h.kv_sent else None
        if svc._active.get(rid) is a:
            svc._loop.inject(f"{rid}#0", a.req.prompt_token_ids, h.first_token, a.params[0], payload)
