"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, batched through the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams


@dataclass(slots=True)
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str = "smollm2", **engine_kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        results: list[GenerationResult] = []
        owners: dict[str, tuple[int, int]] = {}
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            results.append(GenerationResult(p if isinstance(p, str) else None, ids))
            self._add(ids, params, i, results[-1], owners)
        bar = tqdm(total=len(owners), desc="generate", unit="seq", disable=not use_tqdm)
        texts = {rid: [] for rid in owners}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                i, k = owners[out.request_id]
                comp = results[i].outputs[k]
                comp.token_ids.extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                if out.logprobs:
                    comp.logprobs = comp.logprobs or []
                    comp.logprobs.extend(out.logprobs)
                if out.finished:
                    comp.finish_reason = out.finish_reason
                    comp.text = "".join(texts[out.request_id])
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, out.num_cached_tokens)
                    bar.update(1)
        bar.close()
        return results

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[GenerationResult]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _add(self, ids: list[int], params: SamplingParams, i: int, res: GenerationResult,
             owners: dict[str, tuple[int, int]]) -> None:
        # n > 1: n sibling requests; prefix caching lets them share the prompt's KV blocks.
        first = None
        for k in range(params.n):
            rid = f"offline-{next(self._ids)}"
            child = params if params.n == 1 else replace(params, n=1, seed=None if params.seed is None
                                                           else params.seed + k)
            self.engine.add_request(rid, ids, child)
            req = self.engine.scheduler.by_id[rid]
            if first is None:
                first = req
            else:
                req.wait_for = first
            owners[rid] = (i, k)
            res.outputs.append(Completion(k, "", [], None))
