"""The engine under test: teacher-forced decode-step logits, and greedy generation through `LLM`.

Scoring runs on the engine's own model object and LM head (packed/quantized linears, the decode
fast path, the runner's float32 head) with a private KV cache: writing into the engine's cache
would clobber blocks its prefix cache still indexes. The scored tokens go in one at a time, so the
logits are those of decode steps (1-row kernels, GGUF activation quantization), not of one long
prefill. It takes an `LLMEngine`, so an EP rank's engine (ep.py) scores the same way.
"""
from __future__ import annotations

import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.llm import LLM
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.sampling import SamplingParams
from moebus.eval.text import Chunk


@torch.inference_mode()
def decode_logits(eng: LLMEngine, chunk: Chunk) -> torch.Tensor:
    """float32 [len(chunk.targets), V]: prefill the context, then one decode step per scored row."""
    model, cfg = eng.model, eng.config
    bs, dev, n = cfg.block_size, torch.device(cfg.device), len(chunk.tokens)
    num_blocks = -(-n // bs)
    caches = allocate_kv_caches(model.kv_cache_specs(), num_blocks, bs, cfg.torch_dtype, dev)
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev).unsqueeze(0)  # block i holds positions i*bs..

    def forward(start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=dev)
        meta = AttentionMetadata([0, end - start], [end], positions, table,
                                 torch.tensor([end], dtype=torch.int32, device=dev), bs,
                                 batch_invariant=eng.runner.batch_invariant)
        ids = torch.tensor(chunk.tokens[start:end], device=dev)
        return model(ids, positions, meta, caches)

    forward(0, chunk.first)
    head = eng.runner.head.logits  # the LM head path the engine's sampler reads (engine/lm_head.py)
    rows = [head(forward(p, p + 1)[-1:]) for p in range(chunk.first, n - 1)]
    return torch.cat(rows).float().cpu()


def greedy_params(max_tokens: int) -> SamplingParams:
    """Every generation mode's params: exactly max_tokens greedy tokens (EOS neither stops nor is banned)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, batched: bool) -> list[list[int]]:
    """batched: every prompt in one generate call (continuous batching); else one call each."""
    params = greedy_params(max_tokens)
    calls = [prompts] if batched else [[p] for p in prompts]
    return [r.outputs[0].token_ids for call in calls for r in llm.generate(call, params)]


def spec_counters(eng: LLMEngine) -> dict[str, int]:
    """Draft tokens proposed and accepted, for a speculating engine (none otherwise): greedy output
    that equals the plain engine's says something only if drafts were made."""
    if not eng.config.num_speculative_tokens:
        return {}
    return {"drafted": eng.spec_stats.num_draft_tokens, "accepted": eng.spec_stats.num_accepted}
