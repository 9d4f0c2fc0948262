"""The disagg rows: greedy generation split over two engines in one process, as a disaggregated
deployment splits it over workers (minus the transport, which moves the same payload).

Per prompt the prefill engine runs the prompt, samples the first token and hands back the prompt's
KV (kv.transfer.prefill); the decode engine admits the request with that KV (inject_prefilled) and
decodes the rest. The decode engine keeps no prefix cache, so every prompt's whole KV is the moved
one; one prompt at a time, as the `alone` rows, so the tokens can be compared with theirs.
"""
from __future__ import annotations

from collections.abc import Mapping

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.eval.candidate import greedy_params
from moebus.kv.transfer import inject_prefilled, prefill


def prefill_engine(model: str, engine_kwargs: Mapping[str, object]) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, **engine_kwargs))


def decode_engine(model: str, engine_kwargs: Mapping[str, object]) -> LLMEngine:
    """No prefix cache: a hit would hold an earlier prompt's moved blocks instead of this one's."""
    return LLMEngine(EngineConfig(model=model, **{**engine_kwargs, "enable_prefix_caching": False}))


def generate(pre: LLMEngine, dec: LLMEngine, prompts: list[list[int]],
             max_tokens: int) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens per prompt (the first from `pre`, the rest from `dec`) and what moved."""
    params = greedy_params(max_tokens)
    out: list[list[int]] = []
    moved = {"kv_prompts": 0, "kv_blocks": 0, "kv_tokens": 0}
    for i, prompt in enumerate(prompts):
        first = prefill(pre, f"eval-prefill-{i}", prompt, params)
        if first.payload is None:  # max_tokens 1: done at the first token, no decode stage
            out.append([first.first_token])
            continue
        rid = f"eval-decode-{i}"
        res = inject_prefilled(dec, rid, prompt, first.first_token, params, first.payload)
        if not res.injected:  # it would recompute the prompt: no longer a disaggregated measurement
            dec.abort_request(rid)
            raise RuntimeError(f"the decode engine refused prompt #{i}'s KV: {res.reason}")
        moved["kv_prompts"] += 1
        moved["kv_blocks"] += res.num_copied_blocks
        moved["kv_tokens"] += res.num_tokens
        out.append([first.first_token, *_drain(dec, rid)])
    return out, moved


def _drain(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id:
                tokens.extend(o.new_token_ids)
    return tokens
