"""An engine's KV connector (`LLMEngine.kv`): what a worker asks of the engine to move KV.

Extract a prefilled request's KV, admit a request prefilled elsewhere, load a prompt's prefix
from a KV tier, report prefix-cache events, offload new blocks to a tier: each is a verb here,
carried out by transfer / tiers / cache_events through the verbs of the KVHost it is given
(host.py: the engine's, scheduler's and block manager's public verbs), never the engine itself.
Satisfies connector_port.KVConnectorPort; call it on the engine's thread, between steps.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moebus.engine.multimodal import ImageSpan
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


class KVConnector:
    def __init__(self, host: KVHost) -> None:
        self._host = host

    @property
    def namespace(self) -> str:
        return kv_namespace(self._host)

    @property
    def block_size(self) -> int:
        return self._host.block_manager.block_size

    def extract(self, request_id: str) -> KVPayload:
        """The KV of the request's computed prompt (after the step that sampled its first token)."""
        return extract_kv(self._host, request_id)

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
               payload: KVPayload | None, images: Sequence[ImageSpan] = ()) -> InjectResult:
        """Admit a request prefilled elsewhere (payload None or unusable: it recomputes its prompt)."""
        return inject_prefilled(self._host, request_id, prompt_token_ids, first_token, params, payload,
                                images=images)

    def load_prefix(self, request_id: str, store: TieredKVStore, namespace: str | None = None) -> int:
        """Fill the prefix cache with the blocks of the request's prompt the store holds."""
        return load_prefix(self._host, request_id, store, namespace)

    def cache_events(self, tracker: CacheEventTracker) -> tuple[list[int], list[int]]:
        """(stored, evicted) stable hashes of the device prefix cache since the tracker's last poll."""
        return tracker.poll(self._host)

    def offload(self, offloader: KVOffloader) -> list[int]:
        """Copy newly computed full blocks into the offloader's store; their stable hashes."""
        return offloader.offload(self._host)
