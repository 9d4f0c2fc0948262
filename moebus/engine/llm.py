"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, batched through the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.multimodal import ImageSpan
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

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, images: list[list[ImageSpan]] | None = None) -> list[GenerationResult]:
        """params: one for every prompt, or a list of one per prompt (as vLLM's LLM takes them);
        images: per prompt, encoder rows for its image placeholder tokens (engine/multimodal.py)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        results: list[GenerationResult] = []
        owners: dict[str, int] = {}  # engine request id -> prompt index
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            results.append(GenerationResult(p if isinstance(p, str) else None, ids))
            rid = f"offline-{next(self._ids)}"
            # n > 1: the engine fans out n choices sharing the prompt's KV blocks
            self.engine.add_request(rid, ids, per_prompt[i], images=images[i] if images else ())
            owners[rid] = i
            results[-1].outputs = [Completion(k, "", [], None) for k in range(per_prompt[i].n)]
        bar = tqdm(total=sum(p.n for p in per_prompt), desc="generate", unit="seq", disable=not use_tqdm)
        texts: dict[tuple[str, int], list[str]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                i = owners[out.request_id]
                comp = results[i].outputs[out.index]
                comp.token_ids.extend(out.new_token_ids)
                texts.setdefault((out.request_id, out.index), []).append(out.new_text)
                if out.logprobs:
                    comp.logprobs = comp.logprobs or []
                    comp.logprobs.extend(out.logprobs)
                if out.finished:
                    comp.finish_reason = out.finish_reason
                    comp.text = "".join(texts.pop((out.request_id, out.index)))
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, out.num_cached_tokens)
                    bar.update(1)
        bar.close()
        return results

    def chat(self, conversations: list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[GenerationResult]:
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)
