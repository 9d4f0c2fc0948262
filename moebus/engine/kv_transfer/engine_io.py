"""Reading a request's KV out of an engine and admitting a prefilled request into another.

Only public verbs are used: the engine's (get_request, settled_tokens, add_prefilled, kv_caches),
the scheduler's (reserve_prefilled / admit_prefilled) and the block manager's; call these on the
engine's own thread, between steps (LLMEngine.kv, the KV connector, wraps them for a worker).
A layer's cache is the tuple (k, v, *planes) (DeepSeek-V4's compressed layers add compressor
planes); every tensor of it moves, checked against the receiving cache tensor by tensor.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moebus.engine.kv_transfer.hashing import kv_namespace, stable_block_hashes
from moebus.engine.kv_transfer.payload import KVPayload, LayerKV
from moebus.engine.model_runner import PLACEHOLDER
from moebus.engine.multimodal import ImageSpan
from moebus.engine.outputs import RequestOutput
from moebus.engine.request import Request
from moebus.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from moebus.engine.llm_engine import LLMEngine

KVCaches = list[tuple[torch.Tensor, ...]]  # per layer (k, v, *planes), each indexed by block id first


def kv_block_ids(req: Request) -> list[int]:
    """The request's cache blocks by logical block index, shared by every tensor of every layer.
    The one place kv_transfer / kv_tiers read a request's block table."""
    return req.block_ids


def gather_blocks(kv_caches: KVCaches, block_ids: list[int], device: str | torch.device = "cpu") -> LayerKV:
    """Per layer (k, v, *planes), each [len(block_ids), ...]: one gather per cache tensor."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    return [tuple(t.index_select(0, idx).to(device) for t in layer) for layer in kv_caches]


def layout_problem(layers: LayerKV, kv_caches: KVCaches) -> str:
    """Why per-layer block data cannot go into these caches ("" when it can): every layer must
    bring as many tensors as its cache tuple, each with the cache tensor's per-block shape."""
    if len(layers) != len(kv_caches):
        return f"payload has {len(layers)} layers, the cache {len(kv_caches)}"
    for i, (src, dst) in enumerate(zip(layers, kv_caches, strict=True)):
        if len(src) != len(dst):
            return f"layer {i}: {len(src)} cache tensors, the cache {len(dst)}"
        for j, (s, d) in enumerate(zip(src, dst, strict=True)):
            if s.shape[1:] != d.shape[1:]:
                return f"layer {i} tensor {j}: block shape {tuple(s.shape[1:])}, the cache {tuple(d.shape[1:])}"
    return ""


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], layers: LayerKV) -> None:
    """Write per-layer block data (first len(block_ids) blocks of each tensor) into the cache."""
    if problem := layout_problem(layers, kv_caches):
        raise ValueError(problem)
    n = len(block_ids)
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    for dst, src in zip(kv_caches, layers, strict=True):
        for d, s in zip(dst, src, strict=True):
            d.index_copy_(0, idx, s[:n].to(d.device, d.dtype))


def lookup(engine: LLMEngine, request: str | Request) -> Request:
    """The live engine request (of an n > 1 request: its first choice); KeyError if none."""
    return request if isinstance(request, Request) else engine.get_request(request)


def settled_tokens(engine: LLMEngine, req: Request) -> int:
    """Tokens whose KV is written (LLMEngine.settled_tokens)."""
    return engine.settled_tokens(req)


def extract_kv(engine: LLMEngine, request: str | Request, num_tokens: int | None = None,
               device: str | torch.device = "cpu") -> KVPayload:
    """Copy the KV of the request's first num_tokens tokens (default: its computed prompt) out of
    the engine. Call it after the step that sampled the first token, before aborting it."""
    req = lookup(engine, request)
    bs = engine.block_manager.block_size
    settled = engine.settled_tokens(req)
    n = min(settled, req.num_prompt_tokens) if num_tokens is None else num_tokens
    nb = -(-n // bs)
    blocks = kv_block_ids(req)
    if n <= 0 or n > settled or nb > len(blocks):
        raise ValueError(f"{req.request_id}: {n} tokens requested, {settled} computed")
    tokens = req.all_token_ids[:n]
    ns = kv_namespace(engine)
    outs = req.output_token_ids
    return KVPayload(gather_blocks(engine.kv_caches, blocks[:nb], device), bs, n, tokens,
                     stable_block_hashes(req.hash_token_ids[:n], bs, ns), ns, req.request_id,
                     outs[0] if outs and outs[0] != PLACEHOLDER else None,
                     req.generator.get_state() if req.generator is not None else None)


@dataclass(slots=True)
class InjectResult:
    injected: bool  # False: the request was queued to recompute its prompt (see reason)
    num_tokens: int = 0  # prompt tokens whose KV is now present
    num_copied_blocks: int = 0
    num_local_hit_blocks: int = 0  # blocks the decode engine's own prefix cache already had
    reason: str = ""


def _payload_problem(engine: LLMEngine, prompt: list[int], payload: KVPayload | None) -> str:
    if payload is None:
        return "no payload"
    if payload.namespace and payload.namespace != kv_namespace(engine):
        return f"namespace {payload.namespace!r} differs"
    if payload.block_size != engine.block_manager.block_size:
        return "block size differs"
    n = min(payload.num_tokens, len(prompt))
    if n <= 0 or (payload.token_ids and payload.token_ids[:n] != prompt[:n]):
        return "payload tokens are not a prefix of the prompt"
    return layout_problem(payload.layers, engine.kv_caches)


def inject_prefilled(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], first_token: int,
                     params: SamplingParams, payload: KVPayload | None, priority: int = 0,
                     images: Sequence[ImageSpan] = ()) -> InjectResult:
    """Admit a request whose prompt was prefilled elsewhere: its KV comes from `payload` and its
    first output token is `first_token` (already streamed by the prefill worker, so not emitted
    again). The next step() decodes the second token. Any problem with the payload (missing,
    mismatched, no free blocks) queues the request to recompute prompt + first token instead,
    which gives the same result, only slower."""
    state = payload.generator_state if payload is not None else None
    req = engine.add_prefilled(request_id, prompt_token_ids, first_token, params, priority, state, images)
    problem = _payload_problem(engine, prompt_token_ids, payload)
    if problem:
        return InjectResult(False, reason=problem)
    bm, bs = engine.block_manager, engine.block_manager.block_size
    hits = bm.match_prefix(req)
    n = max(min(payload.num_tokens, len(prompt_token_ids)), len(hits) * bs)
    fresh = engine.scheduler.reserve_prefilled(req, n, hits)
    if fresh is None:
        return InjectResult(False, reason="no free KV blocks")
    if fresh:
        scatter_blocks(engine.kv_caches, fresh, [tuple(t[len(hits):] for t in kv) for kv in payload.layers])
    engine.scheduler.admit_prefilled(req, n)  # runs now when there is room, else waits with its KV
    return InjectResult(True, n, len(fresh), len(hits))


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    payload: KVPayload | None  # None: the request finished at its first token (no decode stage)
    output: RequestOutput  # the first output (text, logprobs, finish reason) to stream
    other_outputs: list[RequestOutput] = field(default_factory=list)  # other requests' outputs


def prefill(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, images: Sequence[ImageSpan] = (), **extract_kw: Any) -> PrefillResult:
    """Run a request on a prefill engine until its first token, extract its prompt KV, drop it.
    Pass the request's real params: the first token is sampled (and may finish it) as usual."""
    engine.add_request(request_id, prompt_token_ids, params, priority, images=images)
    others: list[RequestOutput] = []
    while True:
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"{request_id} ended without output")
        outs = engine.step()
        mine = [o for o in outs if o.request_id == request_id]
        others += [o for o in outs if o.request_id != request_id]
        if mine:
            break
    out = mine[0]
    if out.finished:
        return PrefillResult(out.new_token_ids[0], None, out, others)
    payload = extract_kv(engine, request_id, **extract_kw)
    engine.abort_request(request_id)
    return PrefillResult(out.new_token_ids[0], payload, out, others)
