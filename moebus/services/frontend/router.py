"""StreamRouter: the frontend's single wildcard subscription for every request's token stream.

Chunks arrive on ``frontend.stream.<instance>.<request_id>`` and go to that request's queue;
``balancer.worker_lost`` events go to every request running on the lost worker.
"""
from __future__ import annotations

from nats.aio.msg import Msg

from moebus.shared.bus import Bus
from moebus.shared.messages import GenerateRequest, ImageEmbedding, SamplingOptions, TokenChunk, WorkerLost
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects

from .config import FrontendConfig
from .generation import Generation, Lost


class StreamRouter:
    def __init__(self, bus: Bus, subjects: Subjects, instance_id: str, cfg: FrontendConfig,
                 metrics: Metrics) -> None:
        self.bus, self.subjects, self.instance_id, self.cfg = bus, subjects, instance_id, cfg
        self._gens: dict[str, Generation] = {}
        self.migrations = metrics.counter("migrations_total", "Requests moved to another worker: why, and whether "
                                          "they went on from tokens already sent (resumed) or from the start (fresh)",
                                          ["reason", "kind"])
        self.aborts = metrics.counter("aborts_total", "Abort messages sent to workers")

    def __len__(self) -> int:
        return len(self._gens)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.frontend_stream_all(self.instance_id), TokenChunk, self._on_chunk,
                                 concurrent=False, traced=False, endpoint="stream")
        await self.bus.subscribe(self.subjects.balancer_worker_lost, WorkerLost, self._on_lost, concurrent=False,
                                 endpoint="worker_lost")

    def new(self, request_id: str, model: str, prompt_token_ids: list[int], params: SamplingOptions,
            images: list[ImageEmbedding] | None = None, priority: int = 0) -> Generation:
        req = GenerateRequest(request_id=request_id, model=model, prompt_token_ids=prompt_token_ids, params=params,
                              reply_to=self.subjects.frontend_stream(self.instance_id, request_id),
                              images=images or [], priority=priority)
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

    async def _on_lost(self, event: WorkerLost, _: Msg) -> None:
        for gen in list(self._gens.values()):
            if gen.watches(event.worker_id):
                gen.queue.put_nowait(Lost(event.worker_id))
