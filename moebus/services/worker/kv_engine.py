"""Engine-thread side of a worker's KV features (imports torch: real engines only).

Every method runs on the engine thread (EngineLoop calls them between steps), so the engine,
the local tiered store and the connector are only ever touched from that one thread. The engine
is asked through its KV connector (`engine.kv`, moebus.kv.connector_port.KVConnectorPort), which
`bind` attaches with the local tier: from then on the engine's scheduler asks the connector to load
a prompt's prefix from the tier at admission, and its step records cache events and offloads new
blocks; this class takes what was recorded for the worker's index events and the broker. An EP
rank's connector is its own cache's (moved between the group's steps, so no collective is involved).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from moebus.engine.port import EnginePort
from moebus.kv.connector_port import KVConnectorPort
from moebus.kv.payload import KVBlock, KVPayload
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.store import TieredKVStore

log = logging.getLogger(__name__)


def _kv(engine: EnginePort) -> KVConnectorPort:
    if engine.kv is None:
        raise ValueError("this engine has no KV connector")
    return engine.kv


class EngineKV:
    def __init__(self, cpu_bytes: int = 0, share_limit: int = 64,
                 on_corrupt: Callable[[str], None] | None = None) -> None:
        """cpu_bytes: size of the local host-memory tier (0: none); share_limit: most blocks
        handed to the broker's tiers per call of take_fresh (the rest wait for the next);
        on_corrupt(tier): a block of the local tier failed its checksum or named another key,
        model or cache layout ("transfer": a received payload's did); dropped and recomputed."""
        self.on_corrupt = on_corrupt
        self.store: TieredKVStore | None = None  # kept across engine rebuilds: same model, same blocks
        if cpu_bytes > 0:
            self.store = TieredKVStore([CpuTier(cpu_bytes, on_corrupt)], on_evict=self._evicted)
        self.share_limit = share_limit
        self.namespace = ""
        self.block_size = 0
        self._fresh: list[int] = []  # offloaded to the local tier, not yet shared with the broker
        self._cpu_stored: list[int] = []  # ... not yet reported to the index
        self._cpu_evicted: list[int] = []
        # Decode halves: a received payload adopted, or one that arrived and could not be (its
        # request recomputed the prompt: same tokens, slower), its blocks counted when they were
        # another prompt's, model's or layout's. Read from other threads: ints only.
        self.counters = {"kv_injected": 0, "kv_inject_refused": 0, "kv_inject_corrupt_blocks": 0}

    def bind(self, engine: EnginePort) -> None:
        """A new engine (the first, or a rebuilt one): its connector attached to the local tier."""
        kv = _kv(engine)
        self.namespace = kv.namespace
        self.block_size = kv.block_size
        kv.attach(self.store)

    def _evicted(self, hashes: list[int]) -> None:
        self._cpu_evicted += hashes

    def _take_offloaded(self, engine: EnginePort) -> None:
        new = _kv(engine).take_offloaded()
        self._fresh += new
        self._cpu_stored += new

    def extract(self, engine: EnginePort, request_id: str) -> KVPayload:
        return _kv(engine).extract(request_id)

    def inject(self, engine: EnginePort, request_id: str, prompt: list[int], first_token: int, params: Any,
               payload: KVPayload | None, images: Sequence[Any] = ()) -> None:
        res = _kv(engine).inject(request_id, prompt, first_token, params, payload, images)
        if payload is None:
            return  # nothing arrived: the link counted that
        if getattr(res, "injected", False):
            self.counters["kv_injected"] += 1
            return
        self.counters["kv_inject_refused"] += 1
        corrupt = getattr(res, "corrupt_blocks", 0)
        self.counters["kv_inject_corrupt_blocks"] += corrupt
        for _ in range(corrupt if self.on_corrupt is not None else 0):
            self.on_corrupt("transfer")
        log.log(logging.WARNING if self.counters["kv_inject_refused"] == 1 else logging.DEBUG,
                "KV payload of %s refused (%s): its prompt is recomputed", request_id, getattr(res, "reason", "?"))

    # ---- called through EngineLoop.call ----------------------------------------------------
    def poll(self, engine: EnginePort) -> dict[str, tuple[list[int], list[int]]]:
        """Per tier, (stored, evicted) stable hashes since the last poll."""
        out = {"device": _kv(engine).take_events()}
        if self.store is not None:
            self._take_offloaded(engine)
            out["cpu"] = (self._cpu_stored, self._cpu_evicted)
            self._cpu_stored, self._cpu_evicted = [], []
        return out

    def held(self, engine: EnginePort) -> dict[str, list[int]]:
        """Everything held per tier (for snapshots that heal lost events)."""
        out = {"device": _kv(engine).held()}
        if self.store is not None:
            out["cpu"] = [h for t in self.store.tiers for h in t.keys()]
        return out

    def take_fresh(self, engine: EnginePort) -> tuple[list[int], list[KVBlock]]:
        """Newly offloaded blocks (at most share_limit) for the broker's shared tiers."""
        if self.store is not None:
            self._take_offloaded(engine)
        hashes, self._fresh = self._fresh[: self.share_limit], self._fresh[self.share_limit:]
        blocks = [self.store.get(h) for h in hashes] if self.store is not None else []
        kept = [(h, b) for h, b in zip(hashes, blocks, strict=True) if b is not None]
        return [h for h, _ in kept], [b for _, b in kept]

    def put_local(self, engine: EnginePort, hashes: list[int], blocks: list[KVBlock]) -> int:
        if self.store is None:
            return 0
        for h, b in zip(hashes, blocks, strict=False):
            self.store.put(h, b)
        return len(blocks)

    def local_prefix(self, engine: EnginePort, hashes: list[int]) -> int:
        """Leading blocks this worker already has (device prefix cache or local tier)."""
        device = set(_kv(engine).held())
        n = 0
        while n < len(hashes) and (hashes[n] in device or (self.store is not None and hashes[n] in self.store)):
            n += 1
        return n
