"""An engine's KV connector (`LLMEngine.kv`): the one object through which KV enters and leaves
an engine, asked by the engine's scheduler and by the worker (connector_port.py: SchedulerKV and
KVConnectorPort, vLLM's KV-connector shape).

A worker attaches it (`attach`, with the local tier's store or none). From then on the scheduler
asks it to load a waiting request's prefix from the tier just before the request's prompt is
matched against the prefix cache (`before_admit`: tier hits become cache hits, and a request
preempted and admitted again finds its blocks again), and the engine tells it after each step
with outputs (`after_step`: prefix-cache events recorded, newly computed blocks offloaded); the
worker takes what was recorded (`take_events`, `take_offloaded`) when it publishes. The P/D
hand-off stays the worker's to time: `extract` after a prefill step, `inject` to admit.
The work is done by transfer / tiers / cache_events through the verbs of the KVHost it is given
(host.py), never the engine itself. Call it on the engine's thread, between steps.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moebus.engine.multimodal import ImageSpan
from moebus.engine.request import Request
from moebus.engine.sampling import SamplingParams
from moebus.kv.cache_events import CacheEventTracker
from moebus.kv.hashing import kv_namespace
from moebus.kv.payload import KVPayload
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transfer import InjectResult, extract_kv, inject_prefilled

if TYPE_CHECKING:
    from moebus.kv.host import KVHost

log = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, host: KVHost) -> None:
        self._host = host
        self._store: TieredKVStore | None = None
        self._offloader: KVOffloader | None = None
        self._tracker: CacheEventTracker | None = None  # None: not attached (a bare engine)
        self._attached_ns: str | None = None
        self._stored: list[int] = []  # device events since the worker last took them
        self._evicted: list[int] = []
        self._offloaded: list[int] = []

    @property
    def namespace(self) -> str:
        return kv_namespace(self._host)

    @property
    def block_size(self) -> int:
        return self._host.block_manager.block_size

    # ---- worker side --------------------------------------------------------------------------
    def attach(self, store: TieredKVStore | None = None) -> None:
        """Start recording prefix-cache events and, with a store, loading prompts' prefixes from
        it at admission and offloading new blocks to it; the scheduler asks from now on."""
        self._attached_ns = ns = self.namespace  # computed once: it names the model and cache shapes
        self._tracker = CacheEventTracker(ns)
        self._store = store
        self._offloader = KVOffloader(store, ns) if store is not None else None
        self._host.scheduler.attach_kv(self)

    def take_events(self) -> tuple[list[int], list[int]]:
        """(stored, evicted) stable hashes of the device prefix cache since the last take."""
        if self._tracker is None:
            return [], []
        stored, evicted = self._tracker.poll(self._host)  # also what the last step's outputs left
        stored, self._stored = self._stored + stored, []
        evicted, self._evicted = self._evicted + evicted, []
        return stored, evicted

    def take_offloaded(self) -> list[int]:
        offloaded, self._offloaded = self._offloaded, []
        return offloaded

    def held(self) -> list[int]:
        return self._tracker.held if self._tracker is not None else []

    def extract(self, request_id: str) -> KVPayload:
        """The KV of the request's computed prompt (after the step that sampled its first token)."""
        return extract_kv(self._host, request_id)

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
               payload: KVPayload | None, images: Sequence[ImageSpan] = ()) -> InjectResult:
        """Admit a request prefilled elsewhere (payload None or unusable: it recomputes its prompt)."""
        return inject_prefilled(self._host, request_id, prompt_token_ids, first_token, params, payload,
                                images=images)

    # ---- scheduler side -----------------------------------------------------------------------
    def before_admit(self, req: Request) -> None:
        """Fill the prefix cache with the blocks of req's prompt the tier holds. A tier's fault
        costs only the hit: the prompt is computed instead."""
        if self._store is None:
            return
        try:
            load_prefix(self._host, req, self._store, self._attached_ns)
        except Exception:
            log.warning("loading %s's prefix from the KV tier failed: computing it", req.request_id,
                        exc_info=True)

    def after_step(self) -> None:
        """Record the step's prefix-cache events (a short request is gone long before the worker
        next takes them) and offload its newly computed full blocks."""
        if self._tracker is None:
            return
        stored, evicted = self._tracker.poll(self._host)
        self._stored += stored
        self._evicted += evicted
        if self._offloader is not None:
            self._offloaded += self._offloader.offload(self._host)
