"""KVConnectorPort: what a worker asks of an engine's KV (`EnginePort.kv`, moebus.engine.port).

Satisfied by KVConnector (connector.py); tests/engine/test_engine_port.py checks it. Call it on
the engine's thread, between steps. Types only: importing this module loads neither torch nor
the engine, so the engine port stays importable by torch-free services.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from moebus.engine.multimodal import ImageSpan
    from moebus.engine.sampling import SamplingParams
    from moebus.kv.cache_events import CacheEventTracker
    from moebus.kv.payload import KVPayload
    from moebus.kv.tiers.offload import KVOffloader
    from moebus.kv.tiers.store import TieredKVStore
    from moebus.kv.transfer import InjectResult


@runtime_checkable
class KVConnectorPort(Protocol):
    """Moves a request's KV in and out of an engine; call on the engine's thread, between steps."""

    @property
    def namespace(self) -> str: ...  # engines with equal namespaces can exchange blocks

    @property
    def block_size(self) -> int: ...

    def extract(self, request_id: str) -> KVPayload: ...  # the KV of the request's computed prompt

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
               payload: KVPayload | None, images: Sequence[ImageSpan] = ()) -> InjectResult: ...

    def load_prefix(self, request_id: str, store: TieredKVStore, namespace: str | None = None) -> int: ...

    def cache_events(self, tracker: CacheEventTracker) -> tuple[list[int], list[int]]: ...  # (stored, evicted)

    def offload(self, offloader: KVOffloader) -> list[int]: ...  # stable hashes newly copied to the store
