"""KVHost: what the KV code asks of the engine whose paged cache it reads and fills.

The KV code (transfer, tiers.load / tiers.offload, cache_events, connector) never imports the
engine: it is handed an object with these verbs (LLMEngine satisfies KVHost and PrefillHost;
tests/engine/test_engine_port.py checks it). Call them on the engine's thread, between steps.
Types only: importing this module loads nothing of the engine.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from moebus.engine.block_manager import BlockManager
    from moebus.engine.config import EngineConfig
    from moebus.engine.multimodal import ImageSpan
    from moebus.engine.outputs import RequestOutput
    from moebus.engine.request import Request
    from moebus.engine.sampling import SamplingParams
    from moebus.kv.connector_port import SchedulerKV
    from moebus.kv.groups import KVLayout


@runtime_checkable
class KVScheduler(Protocol):
    """The scheduler's verbs for KV that comes from elsewhere (engine/scheduler.py)."""

    def holding_kv(self) -> list[Request]: ...  # requests that hold KV blocks

    def reserve_prefilled(self, req: Request, num_tokens: int, cached: list[int] = ()) -> list[int] | None: ...

    def admit_prefilled(self, req: Request, num_tokens: int) -> None: ...

    def attach_kv(self, kv: SchedulerKV) -> None: ...  # asked before each admission from then on


@runtime_checkable
class KVHost(Protocol):
    """An engine's paged KV cache, its block manager and scheduler, and its live requests."""

    config: EngineConfig  # model, dtype, block size: the KV namespace (hashing.kv_namespace)
    kv_layout: KVLayout  # which cache part lives in which block pool (groups.py)
    block_manager: BlockManager
    scheduler: KVScheduler

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, ...]]: ...  # per layer (k, v, *planes), by block id

    def get_request(self, request_id: str, index: int = 0) -> Request: ...  # KeyError if none

    def settled_tokens(self, req: Request) -> int: ...  # tokens of req whose KV is written

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                      params: SamplingParams, priority: int = 0, generator_state: torch.Tensor | None = None,
                      images: Sequence[ImageSpan] = ()) -> Request: ...


@runtime_checkable
class PrefillHost(KVHost, Protocol):
    """A KVHost that also runs requests: what transfer.prefill drives to a request's first token."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, resume: Mapping[int, Sequence[int]] | None = None,
                    images: Sequence[ImageSpan] = ()) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort_request(self, request_id: str) -> bool: ...
