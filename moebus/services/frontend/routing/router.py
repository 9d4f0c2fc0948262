"""StreamRouter: the frontend's single wildcard subscription for every request's token stream.

Chunks arrive on ``frontend.chunks.<instance>`` (a worker's engine step, every stream's chunks
together) or ``frontend.stream.<instance>.<request_id>`` (one chunk) and go to their request's queue;
``balancer.worker_lost`` events go to every request running on the lost worker; the bus going down
or coming back goes to every request (after a reconnect each asks its worker for what it missed),
and so does a worker heard again after a silence to the requests it holds.
"""
from __future__ import annotations

import logging

from nats.aio.msg import Msg

from moebus.kv.hashing import hash_space, stable_block_hashes
from moebus.shared.bus import Bus
from moebus.shared.errors import NoResponders, RequestTimeout, ServiceError
from moebus.shared.messages import (
    GenerateRequest,
    Heartbeat,
    ImageEmbedding,
    KVInfo,
    SamplingOptions,
    TokenChunk,
    TokenChunks,
    WorkerLost,
)
from moebus.shared.messages.generate import ReplayReply, ReplayRequest
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects

from ..config import FrontendConfig
from .generation import BusChanged, Generation, Lost

log = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 2.0


class StreamRouter:
    def __init__(self, bus: Bus, subjects: Subjects, instance_id: str, cfg: FrontendConfig,
                 metrics: Metrics, incarnation: str = "") -> None:
        self.bus, self.subjects, self.instance_id, self.cfg = bus, subjects, instance_id, cfg
        self.incarnation = incarnation  # our process's (workers abort our requests when it dies)
        self._gens: dict[str, Generation] = {}
        self.migrations = metrics.counter("migrations_total", "Requests moved to another worker: why, and whether "
                                          "they went on from tokens already sent (resumed) or from the start (fresh)",
                                          ["reason", "kind"])
        self.aborts = metrics.counter("aborts_total", "Abort messages sent to workers")
        self.replays = metrics.counter("replays_total", "Chunks asked again from a worker after a gap or a bus "
                                       "reconnect: answered (ok), gone (the request migrates), unreachable (asked "
                                       "again), error", ["outcome"])
        self.replayed = metrics.counter("replayed_chunks_total", "Chunks a worker sent again")

    def __len__(self) -> int:
        return len(self._gens)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.frontend_stream_all(self.instance_id), TokenChunk, self._on_chunk,
                                 concurrent=False, traced=False, endpoint="stream")
        await self.bus.subscribe(self.subjects.frontend_chunks(self.instance_id), TokenChunks, self._on_chunks,
                                 concurrent=False, traced=False, endpoint="chunks")
        await self.bus.subscribe(self.subjects.balancer_worker_lost, WorkerLost, self._on_lost, concurrent=False,
                                 endpoint="worker_lost")
        self.bus.watch(self._on_bus)

    def new(self, request_id: str, model: str, prompt_token_ids: list[int], params: SamplingOptions,
            images: list[ImageEmbedding] | None = None, priority: int = 0, owner: str = "",
            kv: KVInfo | None = None) -> Generation:
        """kv: how the model's workers name KV blocks: the prompt is hashed here, once, and the hashes
        travel with it (the balancer's routing and the worker's tier fetch use them)."""
        req = GenerateRequest(request_id=request_id, model=model, prompt_token_ids=prompt_token_ids, params=params,
                              reply_to=self.subjects.frontend_stream(self.instance_id, request_id),
                              images=images or [], priority=priority, owner=owner, frontend_id=self.instance_id,
                              frontend_incarnation=self.incarnation)
        if kv is not None:
            req.block_hashes = stable_block_hashes(req.hash_token_ids(), kv.block_size, kv.namespace)
            req.block_hash_space = hash_space(kv.namespace, kv.block_size)
        return Generation(self, req)

    def register(self, gen: Generation) -> None:
        self._gens[gen.request_id] = gen

    def unregister(self, gen: Generation) -> None:
        if self._gens.get(gen.request_id) is gen:
            del self._gens[gen.request_id]

    async def _on_chunk(self, chunk: TokenChunk, _: Msg) -> None:
        gen = self._gens.get(chunk.request_id)
        if gen is not None:
            gen.queue.put_nowait(chunk)

    async def _on_chunks(self, batch: TokenChunks, _: Msg) -> None:
        for chunk in batch.chunks:
            if (gen := self._gens.get(chunk.request_id)) is not None:
                gen.queue.put_nowait(chunk)

    async def replay(self, worker: str, req: ReplayRequest) -> ReplayReply | None:
        """The chunks `worker` already sent for a request; None when it cannot answer now."""
        try:
            reply = await self.bus.request(self.subjects.worker_replay(worker), req, ReplayReply,
                                           timeout=REPLAY_TIMEOUT_S, idempotent=True)  # (a blip cuts it short)
        except (NoResponders, RequestTimeout) as e:
            log.debug("replay of %s from %s: %s", req.request_id, worker, e)
            self.replays.labels("unreachable").inc()
            return None
        except ServiceError as e:
            log.warning("replay of %s from %s failed: %s", req.request_id, worker, e)
            self.replays.labels("error").inc()
            return None
        self.replays.labels("gone" if reply.gone else "ok").inc()
        self.replayed.inc(len(reply.chunks))
        return reply

    def _on_bus(self, connected: bool) -> None:
        # Our own close at shutdown, with nothing in flight, loses nothing: INFO. A drop we did not
        # ask for, or one that cuts streams, is a WARNING.
        quiet = connected or (self.bus.closing and not self._gens)
        log.log(logging.INFO if quiet else logging.WARNING, "bus %s: %d streams in flight",
                "back" if connected else "down", len(self._gens))
        for gen in list(self._gens.values()):
            gen.queue.put_nowait(BusChanged(connected))

    def heard_again(self, beat: Heartbeat) -> None:
        """A worker silent for a while beats again (a partition healed, a pause ended): the chunks it
        sent meanwhile went nowhere, and a stream it finished shows no gap, so each of its requests
        asks for what it missed, as after our own reconnect."""
        if beat.service != "worker":
            return
        for gen in list(self._gens.values()):
            if gen.watches(beat.instance_id):
                gen.queue.put_nowait(BusChanged(True))

    async def _on_lost(self, event: WorkerLost, _: Msg) -> None:
        for gen in list(self._gens.values()):
            if gen.watches(event.worker_id):
                gen.queue.put_nowait(Lost(event.worker_id))
