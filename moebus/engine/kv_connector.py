"""An engine's KV connector (`LLMEngine.kv`): what a worker asks of the engine to move KV.

Extract a prefilled request's KV, admit a request prefilled elsewhere, load a prompt's prefix
from a KV tier, report prefix-cache events, offload new blocks to a tier: each is a verb here,
carried out by kv_transfer / kv_tiers through the engine's, scheduler's and block manager's public
verbs. Satisfies moebus.engine.port.KVConnectorPort; call it on the engine's thread, between steps.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moebus.engine.kv_tiers.engine_io import KVOffloader, load_prefix
from moebus.engine.kv_tiers.events import CacheEventTracker
from moebus.engine.kv_tiers.store import TieredKVStore
from moebus.engine.kv_transfer.engine_io import InjectResult, extract_kv, inject_prefilled
from moebus.engine.kv_transfer.hashing import kv_namespace
from moebus.engine.kv_transfer.payload import KVPayload
from moebus.engine.multimodal import ImageSpan
from moebus.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from moebus.engine.llm_engine import LLMEngine


class KVConnector:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    @property
    def namespace(self) -> str:
        return kv_namespace(self._engine)

    @property
    def block_size(self) -> int:
        return self._engine.block_manager.block_size

    def extract(self, request_id: str) -> KVPayload:
        """The KV of the request's computed prompt (after the step that sampled its first token)."""
        return extract_kv(self._engine, request_id)

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
               payload: KVPayload | None, images: Sequence[ImageSpan] = ()) -> InjectResult:
        """Admit a request prefilled elsewhere (payload None or unusable: it recomputes its prompt)."""
        return inject_prefilled(self._engine, request_id, prompt_token_ids, first_token, params, payload,
                                images=images)

    def load_prefix(self, request_id: str, store: TieredKVStore, namespace: str | None = None) -> int:
        """Fill the prefix cache with the blocks of the request's prompt the store holds."""
        return load_prefix(self._engine, request_id, store, namespace)

    def cache_events(self, tracker: CacheEventTracker) -> tuple[list[int], list[int]]:
        """(stored, evicted) stable hashes of the device prefix cache since the tracker's last poll."""
        return tracker.poll(self._engine)

    def offload(self, offloader: KVOffloader) -> list[int]:
        """Copy newly computed full blocks into the offloader's store; their stable hashes."""
        return offloader.offload(self._engine)
