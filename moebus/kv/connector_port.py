"""The KV connector's two faces (vLLM's KV-connector shape): what the engine's scheduler and step
ask of it, and what a worker asks of it. Satisfied by KVConnector (connector.py);
tests/engine/test_engine_port.py checks it.

- Scheduler side (`SchedulerKV`): once a worker has attached the connector, the scheduler asks it,
  before matching a waiting request's prompt against the prefix cache, to load the blocks a KV
  tier holds (`before_admit`); the engine tells it after every step that produced outputs
  (`after_step`: record prefix-cache events, offload newly computed blocks).
- Worker side (`KVConnectorPort`): attach a tier, take what the hooks recorded, and the P/D
  hand-off (extract a prefilled request's KV, admit a request prefilled elsewhere), whose timing
  the worker owns.

Call both on the engine's thread, between steps. Types only: importing this module loads neither
torch nor the engine, so the engine port stays importable by torch-free services.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from moebus.engine.multimodal import ImageSpan
    from moebus.engine.request import Request
    from moebus.engine.sampling import SamplingParams
    from moebus.kv.payload import KVPayload
    from moebus.kv.tiers.store import TieredKVStore
    from moebus.kv.transfer import InjectResult


@runtime_checkable
class SchedulerKV(Protocol):
    """What the scheduler and the engine's step ask of an attached connector."""

    def before_admit(self, req: Request) -> None: ...  # a waiting request with nothing computed

    def after_step(self) -> None: ...  # a step produced outputs: events and offload


@runtime_checkable
class KVConnectorPort(Protocol):
    """What a worker asks of an engine's KV; call on the engine's thread, between steps."""

    @property
    def namespace(self) -> str: ...  # engines with equal namespaces can exchange blocks

    @property
    def block_size(self) -> int: ...

    def attach(self, store: TieredKVStore | None = None) -> None: ...  # start the scheduler's hooks

    def take_events(self) -> tuple[list[int], list[int]]: ...  # device (stored, evicted) since last

    def take_offloaded(self) -> list[int]: ...  # stable hashes newly copied to the store since last

    def held(self) -> list[int]: ...  # stable hashes the device prefix cache holds

    def extract(self, request_id: str) -> KVPayload: ...  # the KV of the request's computed prompt

    def inject(self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
               payload: KVPayload | None, images: Sequence[ImageSpan] = ()) -> InjectResult: ...
