"""Generation traffic: frontend -> balancer -> worker, and the token stream back.

Prefill/decode split: `stage` says which part a worker runs; `kv_transfer` (a KVTransferSpec)
names the transfer between the two workers of one attempt. ``stage="aggregated"``: one worker
does both.
"""
from __future__ import annotations

from typing import Literal

from moebus.kv.hashing import mm_hash_view, prompt_block_hashes

from ..codec import Message
from .encoder import ImageEmbedding


class StructuredOptions(Message):
    """Exactly one constraint (validated by the engine's StructuredOutputParams)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF, as xgrammar takes it
    param: str | None = None  # the API field it came from (e.g. guided_regex): a 400 about it names it


class SamplingOptions(Message):
    """Wire mirror of engine.sampling.SamplingParams (same names, same defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    structured: StructuredOptions | None = None
    logit_bias: dict[int, float] = {}  # token id -> added to its logit


class KVTransferSpec(Message):
    """Where the prefill worker pushes the prompt's KV and the first token (one attempt)."""

    transfer_id: str  # f"{request_id}#{attempt}"
    prefill_worker: str
    decode_worker: str
    address: str  # the decode worker's KV transport address
    timeout_s: float = 30.0  # how long the decode worker waits for the first token / the KV


class ResumedChoice(Message):
    """A choice of a migrated request and the tokens the client already has of it."""

    index: int
    token_ids: list[int]


class GenerateRequest(Message):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingOptions = SamplingOptions()
    reply_to: str  # subject that receives this request's TokenChunks
    attempt: int = 0  # bumped on every retry; chunks of older attempts are dropped
    stage: Literal["aggregated", "prefill", "decode"] = "aggregated"
    kv_transfer: KVTransferSpec | None = None  # stage prefill / decode
    exclude_workers: list[str] = []  # balancer skips these (e.g. the worker that just died)
    # An earlier attempt was on an engine that broke (or a worker that died): it runs in a batch of
    # suspects only, split when it breaks the engine again (worker quarantine); isolate: alone.
    suspect: bool = False
    isolate: bool = False
    # A migrated request: the choices still open, each going on from the tokens already streamed
    # (empty: every choice from the start). Chunk numbers (seq) restart at 0 with each attempt.
    resume: list[ResumedChoice] = []
    images: list[ImageEmbedding] = []  # encoder rows for the prompt's image placeholders (offsets set)
    priority: int = 0  # its tenant's: the engine queue runs lower first (frontend/admission/tenants.py)
    # The API call it is part of (a completions call's prompts share one): its fair share of a
    # worker's batch (engine/scheduler.py). Empty: the request itself.
    owner: str = ""
    # The frontend streaming it and that process's life (Heartbeat.incarnation): the worker aborts
    # the request when that frontend dies (worker/leases.py). Empty: nobody's lease.
    frontend_id: str = ""
    frontend_incarnation: str = ""
    # The prompt's stable KV block hashes (kv/hashing.py, over hash_token_ids()), computed
    # once by the frontend in the space its workers named (`block_hash_space`) and reused by the
    # balancer and the worker. Empty: not hashed (no worker's KV info known yet, or the toy engine).
    block_hashes: list[int] = []
    block_hash_space: str = ""

    def hash_token_ids(self) -> list[int]:
        """The prompt as KV block hashes see it: image placeholders carry their image's hash."""
        return mm_hash_view(self.prompt_token_ids, [(i.offset, i.num_tokens, i.content_hash) for i in self.images])

    def block_hashes_in(self, block_size: int, namespace: str) -> list[int]:
        """The prompt's block hashes in that KV space (carried, else computed: kv/hashing.py)."""
        return prompt_block_hashes(self.hash_token_ids(), block_size, namespace, self.block_hashes,
                                   self.block_hash_space)


class GenerateAccepted(Message):
    request_id: str
    worker_id: str
    attempt: int = 0
    decode_worker_id: str | None = None  # split requests: chunks after the first come from it


class TopLogprob(Message):
    token_id: int
    token: str = ""
    logprob: float


class TokenLogprob(Message):
    token_id: int
    token: str = ""  # the token's own text (may be a partial UTF-8 character: U+FFFD)
    logprob: float
    top: list[TopLogprob] = []  # best first


class TokenChunk(Message):
    """New tokens of one choice of one request (a worker sends one per engine step)."""

    request_id: str
    worker_id: str
    attempt: int = 0
    index: int = 0  # choice index, for n > 1
    seq: int = 0  # per-choice sequence number, to spot gaps
    token_ids: list[int] = []
    # Text of these tokens when the worker's engine detokenizes (stop strings already applied);
    # None: the frontend detokenizes through the tokenizer service.
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # finish "stop": the stop token id or stop string (eos: None)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # A failure of the whole request; `retryable` means another worker may run it from scratch.
    error: str | None = None
    error_message: str | None = None
    retryable: bool = False
    failed_worker: str | None = None  # the worker at fault when it is not the sender (a split's other half)
    error_param: str | None = None  # the request field at fault (error bad_request: the 400's param)


class TokenChunks(Message):
    """A worker's chunks for one frontend, every stream's of an engine step together: at c=64 one
    message a step instead of 64 (each a publish, a server hop and a callback on 2 shared cores)."""

    chunks: list[TokenChunk] = []

    @staticmethod
    def join(encoded: list[bytes]) -> bytes:
        """TokenChunks' encoding from its chunks' own (each already encoded for the replay buffer)."""
        return b'{"chunks":[' + b",".join(encoded) + b"]}"


class Handoff(Message):
    """Prefill worker -> decode worker: the first token (already streamed to the client)."""

    request_id: str
    attempt: int = 0
    first_token: int | None = None  # None: the prefill failed; the decode worker hands back
    finished: bool = False  # the request ended at its first token: nothing to decode
    kv_sent: bool = False  # the KV payload went out (else: recompute the prompt)


class HandoffBeat(Message):
    """Prefill -> decode worker, every beat: the split requests (transfer ids) it still holds,
    queued, prefilling or handing over. A decode half whose prefill half goes unnamed for the
    decode worker's `handoff_lost_s` gives it up (retryable: the frontend moves it on)."""

    worker_id: str
    transfer_ids: list[str] = []


class AbortRequest(Message):
    request_id: str
    reason: str = "client"
    # The attempt it ends (None: whichever runs). A frontend moving a request on names the attempt it
    # leaves: its new attempt may reach the same worker first (another path over the bus), and
    # must not be ended by the old one's abort.
    attempt: int | None = None


class ReplayRequest(Message):
    """Frontend -> the worker of a request: the chunks it already sent again, from `from_seq` on
    (a bus blip lost some: a gap in the sequence numbers, or the tail after a reconnect)."""

    request_id: str
    attempt: int = 0
    from_seq: dict[int, int] = {}  # choice index -> the first chunk number wanted


class ReplayReply(Message):
    request_id: str
    # The worker no longer has what was asked (it restarted, or its replay buffer let it go):
    # the frontend moves the request on from the tokens it has (migration).
    gone: bool = False
    chunks: list[TokenChunk] = []  # per choice in order; a terminal error chunk last
    more: bool = False  # cut short to fit one message: ask again from after the last ones
