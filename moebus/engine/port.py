"""The engine port: what a worker needs of the engine it runs (torch-free: services import it
without loading an engine).

Satisfied by `LLMEngine` (engine/llm_engine.py), the expert-parallel group's `DPEngine`
(engine/distributed/dp_engine.py) and the toy engine (devmodel/toy.py);
tests/engine/test_engine_port.py checks all three. The contract:

- `add_request(request_id, prompt_token_ids, params, priority=0)` validates and queues; a request
  it refuses raises (ValueError for bad input) and leaves nothing behind. `params.n > 1` fans out
  inside the engine: n choices, choice i seeded `params.seed + i`, the later ones waiting for the
  first one's prefill so that they share the prompt's KV blocks. `resume` (a migrated request)
  maps each choice still to run to the tokens it produced elsewhere; the choice continues from
  them as if this engine had sampled them (engine/resume.py).
- `step()` runs one step and returns its outputs: each names the caller's `request_id` and the
  choice `index`; `error` set (finish_reason "error") fails that choice, `retryable` when the
  fault was the step's and another engine may run it; `error_param` when it was the request's own
  (the field at fault: a 400, e.g. a grammar too costly to follow).
- `prepare(params)`: work a request needs before `add_request` that must not run on the thread
  that steps (compiling its grammar, under a deadline): a future that settles when add_request
  may be called (its exception, a `RequestRefused`, refuses the request), or None when there is
  nothing to wait for (as a second call finds once the first settled well: the work is kept).
- `abort_request(request_id)` ends every choice of the request and frees its KV (False: none live).
- `failed_steps_in_a_row`: steps that failed with nobody to blame (the owner may rebuild the engine).
- `lockstep`: `step()` is a collective; call it every iteration, idle or not (see `LockstepEngine`).
- `kv`: the engine's KV connector (moebus.kv.connector_port.KVConnectorPort: extract / inject / load a
  prefix / cache events / offload), or None when the engine has no paged KV to move (the toy engine).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from moebus.kv.connector_port import KVConnectorPort
from moebus.kv.hashing import BlockHashes


class RequestRefused(ValueError):
    """A request refused for what it asks: `param` names the request field at fault (an HTTP 400
    naming it); `retryable`: refused for now only (the engine is busy), another engine may take it."""

    def __init__(self, message: str, *, param: str | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.param, self.retryable = param, retryable


@runtime_checkable
class EngineOutput(Protocol):
    request_id: str  # as given to add_request
    index: int  # the choice (0 .. n-1)
    new_token_ids: list[int]
    new_text: str | None  # None: the engine does not detokenize (the frontend does)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None
    retryable: bool
    error_param: str | None  # error is the request's own (a 400): the field at fault, never retried


@runtime_checkable
class EnginePort(Protocol):
    tokenizer: Any  # encode / decode / eos_token_ids (the worker decodes logprob tokens with it)
    lockstep: bool
    failed_steps_in_a_row: int

    @property
    def kv(self) -> KVConnectorPort | None: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    priority: int = 0, resume: Mapping[int, Sequence[int]] | None = None,
                    images: Sequence[Any] = (), owner: str = "", block_hashes: BlockHashes | None = None) -> None: ...

    def prepare(self, params: Any) -> Future[None] | None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> Sequence[EngineOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Mapping[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class LockstepEngine(EnginePort, Protocol):
    group_idle: bool  # set by step(): no rank of the group had work
