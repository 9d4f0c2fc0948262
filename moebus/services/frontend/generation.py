"""One request's life at the frontend: route it, receive its chunks, migrate it, abort it.

Migration: when the worker holding a request is lost (missed heartbeats), drains, or fails with a
retryable error, the request moves to another worker, excluding the ones that failed it, with
every open choice carrying the tokens the client already has (`GenerateRequest.resume`); the new
worker's engine continues from them (engine/resume.py), so the client sees one uninterrupted
response, streamed or not: no token repeated or missing, greedy output identical to an
undisturbed run. A request moves at most `max_migrations` times. A request the engine failed by
itself (invalid, or its own state raised) never moves, and one that broke `max_worker_failures`
workers (they died or their engine failed while holding it) is not sent to another: a poison
request cannot walk the fleet. A draining worker handing a request over does not count as a
failure. Chunks of an older attempt are ignored, so a late worker cannot interleave with its
replacement. A split request (prefill worker, then decode worker) takes chunks from both, in
sequence-number order (they come from two publishers); the prefill worker matters until the
decode worker has streamed, since the KV hand-off between them may still be under way.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import AbortRequest, GenerateAccepted, GenerateRequest, TokenChunk
from moebus.shared.messages.generate import ResumedChoice

if TYPE_CHECKING:
    from .router import StreamRouter


@dataclass(frozen=True, slots=True)
class Lost:
    worker_id: str


class Generation:
    def __init__(self, router: StreamRouter, req: GenerateRequest) -> None:
        self.router, self.req = router, req
        self.queue: asyncio.Queue[TokenChunk | Lost] = asyncio.Queue()
        self.worker_id: str | None = None
        self.decode_worker_id: str | None = None  # split requests: the second half's worker
        self._decoding = False  # the decode worker has streamed: the prefill worker no longer matters
        self.open = set(range(req.params.n))  # choices the worker is still generating
        self.sent: dict[int, list[int]] = {}  # per choice, the tokens passed on to the client
        self._next_seq = [0] * req.params.n
        self._held: dict[tuple[int, int], TokenChunk] = {}  # arrived ahead of their turn
        self._cut = False  # the consumer ended a choice early: the worker must be told
        self.worker_failures = 0  # workers that died or whose engine failed while holding this request
        self.migrations = 0

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
        accepted = await self.router.bus.request(self.router.subjects.balancer_route, self.req, GenerateAccepted,
                                                 timeout=cfg.route_timeout_s, wait_for_responders_s=cfg.restart_wait_s)
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
        idle = self.router.cfg.stream_idle_timeout_s
        while self.open:
            try:
                item = await asyncio.wait_for(self.queue.get(), idle)
            except TimeoutError:
                stuck = self.decode_worker_id if self._decoding else self.worker_id
                item = TokenChunk(request_id=self.request_id, worker_id=stuck or "", attempt=self.req.attempt,
                                  error=ErrorCode.TIMEOUT.value, error_message=f"no tokens for {idle:g}s from "
                                  f"{stuck}", retryable=True)
            if isinstance(item, Lost):
                if not self.watches(item.worker_id):
                    continue
                err, retryable = ServiceError(ErrorCode.WORKER_LOST, f"worker {item.worker_id} was lost"), True
                failed = item.worker_id
            elif item.attempt != self.req.attempt or item.worker_id not in self._workers():
                continue  # from an abandoned attempt
            elif not item.error:
                self._decoding |= item.worker_id == self.decode_worker_id
                for chunk in self._in_order(item):
                    self.sent.setdefault(chunk.index, []).extend(chunk.token_ids)
                    if chunk.finished:
                        self.open.discard(chunk.index)
                    yield chunk
                continue
            else:
                err, retryable = ServiceError(item.error, item.error_message or item.error), item.retryable
                failed = item.failed_worker or item.worker_id
            if retryable and err.code is not ErrorCode.DRAINING:
                self.worker_failures += 1
                if self.worker_failures >= self.router.cfg.max_worker_failures:  # poison: fail it for good
                    err, retryable = ServiceError(ErrorCode.REQUEST_FAILED, f"{err.message} (the request failed on "
                                                  f"{self.worker_failures} workers; it is not sent to another)"), False
            if not retryable or self.migrations >= self.router.cfg.max_migrations:
                raise err
            await self._migrate(failed, err.code)

    def _in_order(self, chunk: TokenChunk) -> list[TokenChunk]:
        """This chunk and any held ones that follow it, once it is its choice's next; a chunk
        that is early waits, one already passed (a duplicate) is dropped."""
        i = chunk.index
        if i >= len(self._next_seq) or chunk.seq < self._next_seq[i]:
            return []
        if chunk.seq > self._next_seq[i]:
            self._held[(i, chunk.seq)] = chunk
            return []
        out = [chunk]
        self._next_seq[i] += 1
        while (nxt := self._held.pop((i, self._next_seq[i]), None)) is not None:
            out.append(nxt)
            self._next_seq[i] += 1
        return out

    async def _migrate(self, failed: str | None, reason: ErrorCode) -> None:
        """Rerun the open choices on another worker from the tokens the client already has."""
        for worker in self._workers():  # alive after all (a NATS blip looks like a death)? stop the old attempt
            await self.router.bus.publish(self.router.subjects.worker_abort(worker),
                                          AbortRequest(request_id=self.request_id, reason="migrated"))
        fresh = self.open == set(range(self.req.params.n)) and not any(self.sent.values())
        resume = [] if fresh else [ResumedChoice(index=k, token_ids=self.sent.get(k, [])) for k in sorted(self.open)]
        excluded = [*self.req.exclude_workers, *([failed] if failed else [])]
        self.req = self.req.model_copy(update={"attempt": self.req.attempt + 1, "exclude_workers": excluded,
                                               "suspect": self.worker_failures > 0, "resume": resume})
        self.worker_id = self.decode_worker_id = None
        self._decoding = False
        self._next_seq, self._held = [0] * self.req.params.n, {}
        self.migrations += 1
        self.router.migrations.labels(reason.value, "fresh" if fresh else "resumed").inc()
        await self._route()

    def finish_choice(self, index: int) -> None:
        """The consumer ended a choice early (a stop string it matched itself)."""
        self.open.discard(index)
        self._cut = True

    async def close(self) -> None:
        """Forget the request; if it is still running (client gone, stop string), abort it on its worker."""
        self.router.unregister(self)
        if (self.open or self._cut) and self.worker_id:
            for worker in self._workers():
                await self.router.bus.publish(self.router.subjects.worker_abort(worker),
                                              AbortRequest(request_id=self.request_id))
            self.router.aborts.inc()
