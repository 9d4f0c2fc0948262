"""One generation request as the scheduler sees it: computed vs target tokens, blocks, status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from moebus.engine.multimodal import ImageSpan, hash_view
from moebus.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # lower runs first, as in vLLM
    owner: str = ""  # the API call it belongs to (its fair share: scheduler.py); "": its own
    arrival_time: float = field(default_factory=time.monotonic)
    max_model_len: int = 8192
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    # The windowed KV group's blocks by logical index (kv.groups); -1: out of the window
    # (freed, or never allocated). Empty when the engine runs one KV group.
    window_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    grammar: Any = None  # engine.sampling.structured state, when constrained
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to verify
    wait_for: Request | None = None  # n>1 siblings wait for the first one's prefill to share blocks
    stop_reason: int | str | None = None
    images: list[ImageSpan] = field(default_factory=list)  # placeholder rows the encoder fills
    # Stable (cross-process) hashes of its full blocks so far and their space (kv/hashing.py:
    # request_block_hashes): seeded with the frontend's, extended as blocks fill.
    stable_hashes: list[int] = field(default_factory=list)
    stable_space: str = ""

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def hash_token_ids(self) -> list[int]:
        """all_token_ids as block hashes see them: image placeholders carry the image's hash."""
        return hash_view(self.all_token_ids, self.images) if self.images else self.all_token_ids

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        budget = self.max_model_len - self.num_prompt_tokens
        return budget if self.params.max_tokens is None else min(self.params.max_tokens, budget)

    def token_at(self, i: int) -> int:
        p = self.num_prompt_tokens
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]
