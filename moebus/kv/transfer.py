"""Reading a request's KV out of an engine and admitting a prefilled request into another.

Only the verbs of a KVHost (host.py) are used: the engine's (get_request, settled_tokens,
add_prefilled, kv_caches), the scheduler's (reserve_prefilled / admit_prefilled) and the block
manager's; call these on the engine's own thread, between steps (the KV connector, connector.py,
wraps them for a worker). The blocks move through cache_io's gathers and scatters; with bounded
sliding windows (kv.groups) a windowed tensor moves only for the blocks the next token's window
reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moebus.engine.model_runner import PLACEHOLDER
from moebus.engine.multimodal import ImageSpan
from moebus.engine.outputs import RequestOutput
from moebus.engine.request import Request
from moebus.engine.sampling import SamplingParams
from moebus.kv.cache_io import (
    gather_blocks,
    gather_grouped,
    kv_block_ids,
    kv_groups,
    layout_problem,
    lookup,
    scatter_blocks,
    scatter_grouped,
)
from moebus.kv.groups import WINDOW
from moebus.kv.hashing import kv_fingerprint, kv_namespace, request_block_hashes
from moebus.kv.payload import Groups, KVPayload

if TYPE_CHECKING:
    from moebus.kv.host import KVHost, PrefillHost


def settled_tokens(engine: KVHost, req: Request) -> int:
    """Tokens whose KV is written (LLMEngine.settled_tokens)."""
    return engine.settled_tokens(req)


def extract_kv(engine: KVHost, request: str | Request, num_tokens: int | None = None,
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
    groups, ws = kv_groups(engine), 0
    if groups is None:
        layers = gather_blocks(engine.kv_caches, blocks[:nb], device)
    else:  # the windowed tensors: only the blocks the window of token n reads
        ws = engine.block_manager.first_live(n)
        window = kv_block_ids(req, WINDOW)[ws:nb]
        if len(window) < nb - ws or min(window, default=0) < 0:
            raise ValueError(f"{req.request_id}: the window blocks of its first {n} tokens are freed")
        layers = gather_grouped(engine.kv_caches, groups, blocks[:nb], window, device)
    return KVPayload(layers, bs, n, tokens, request_block_hashes(req, n // bs, bs, ns), ns,
                     req.request_id, outs[0] if outs and outs[0] != PLACEHOLDER else None,
                     req.generator.get_state() if req.generator is not None else None,
                     groups=groups, window_start=ws)


@dataclass(slots=True)
class InjectResult:
    injected: bool  # False: the request was queued to recompute its prompt (see reason)
    num_tokens: int = 0  # prompt tokens whose KV is now present
    num_copied_blocks: int = 0
    num_local_hit_blocks: int = 0  # blocks the decode engine's own prefix cache already had
    reason: str = ""
    corrupt_blocks: int = 0  # payload blocks dropped for naming another identity (model, layout, hashes)


def _payload_problem(engine: KVHost, req: Request, prompt: list[int],
                     payload: KVPayload | None) -> tuple[str, bool]:
    """Why the payload cannot be adopted ("" when it can), and whether that is its identity: its
    blocks are not this prompt's blocks on this engine (another namespace or KV fingerprint, i.e.
    model, dtype or cache layout; or block hashes other than the prompt's here, e.g. the same
    placeholder tokens for another image), which is counted like damaged blocks."""
    if payload is None:
        return "no payload", False
    ns, bs = kv_namespace(engine), engine.block_manager.block_size
    if payload.namespace and payload.namespace != ns:
        return f"namespace {payload.namespace!r} differs", True
    if payload.fingerprint and payload.fingerprint != kv_fingerprint(ns):
        return "KV fingerprint differs (another model or cache layout)", True
    if payload.block_size != bs:
        return "block size differs", False
    n = min(payload.num_tokens, len(prompt))
    if n <= 0 or (payload.token_ids and payload.token_ids[:n] != prompt[:n]):
        return "payload tokens are not a prefix of the prompt", False
    k = min(len(payload.block_hashes), n // bs)  # token ids only: no pass over the KV
    if payload.block_hashes[:k] != request_block_hashes(req, k, bs, ns):
        return "block hashes differ from the prompt's", True
    if problem := layout_problem(payload.layers, engine.kv_caches):
        return problem, False
    groups = kv_groups(engine)
    if payload.window_start and groups is None:
        return "payload holds only its window's last blocks; this engine keeps whole windows", False
    if payload.groups is not None and groups is not None and payload.groups != groups:
        return "KV groups differ", False
    return "", False


def inject_prefilled(engine: KVHost, request_id: str, prompt_token_ids: list[int], first_token: int,
                     params: SamplingParams, payload: KVPayload | None, priority: int = 0,
                     images: Sequence[ImageSpan] = ()) -> InjectResult:
    """Admit a request whose prompt was prefilled elsewhere: its KV comes from `payload` and its
    first output token is `first_token` (already streamed by the prefill worker, so not emitted
    again). The next step() decodes the second token. Any problem with the payload (missing,
    mismatched, no free blocks) queues the request to recompute prompt + first token instead,
    which gives the same result, only slower; a payload of another identity is counted in
    corrupt_blocks."""
    state = payload.generator_state if payload is not None else None
    req = engine.add_prefilled(request_id, prompt_token_ids, first_token, params, priority, state, images)
    problem, identity = _payload_problem(engine, req, prompt_token_ids, payload)
    if problem:
        return InjectResult(False, reason=problem, corrupt_blocks=payload.num_blocks if identity else 0)
    bm, bs = engine.block_manager, engine.block_manager.block_size
    hits = bm.match_prefix(req)
    n = max(min(payload.num_tokens, len(prompt_token_ids)), len(hits) * bs)
    groups = kv_groups(engine)
    if groups is None:
        fresh = engine.scheduler.reserve_prefilled(req, n, hits)
        if fresh is None:
            return InjectResult(False, reason="no free KV blocks")
        if fresh:
            scatter_blocks(engine.kv_caches, fresh, [tuple(t[len(hits):] for t in kv) for kv in payload.layers])
    else:
        fresh = _reserve_grouped(engine, req, n, hits, payload, groups)
        if isinstance(fresh, str):
            return InjectResult(False, reason=fresh)
    engine.scheduler.admit_prefilled(req, n)  # runs now when there is room, else waits with its KV
    return InjectResult(True, n, len(fresh), len(hits))


def _reserve_grouped(engine: KVHost, req: Request, n: int, hits: list[int], payload: KVPayload,
                     groups: Groups) -> list[int] | str:
    """Full blocks after the local hit and the window blocks token n reads (those the hit does not
    hold), filled from the payload; the fresh full block ids, or why not."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    nb, h = -(-n // bs), len(hits)
    first_fresh = max(bm.first_live(n), h)  # window blocks before it: passed, or the local hit's
    ws = payload.window_start if payload.groups is not None else 0
    if first_fresh < nb and ws > first_fresh:
        return f"payload lacks the window blocks {first_fresh}..{ws - 1} of its {n} tokens"
    req.num_computed_tokens = n  # the window is reserved from token n on (engine.window_blocks)
    fresh = engine.scheduler.reserve_prefilled(req, n, hits)
    if fresh is None:
        req.num_computed_tokens = 0
        return "no free KV blocks"
    window = kv_block_ids(req, WINDOW)[first_fresh:nb]
    starts = (h, first_fresh - ws)
    scatter_grouped(engine.kv_caches, groups, fresh, window,
                    [tuple(t[starts[g]:] for t, g in zip(kv, gs, strict=True))
                     for kv, gs in zip(payload.layers, groups, strict=True)])
    return fresh


@dataclass(slots=True)
class PrefillResult:
    first_token: int
    payload: KVPayload | None  # None: the request finished at its first token (no decode stage)
    output: RequestOutput  # the first output (text, logprobs, finish reason) to stream
    other_outputs: list[RequestOutput] = field(default_factory=list)  # other requests' outputs


def prefill(engine: PrefillHost, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
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
