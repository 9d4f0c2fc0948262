"""Helpers for the EP tests: engine settings, prompts, single-process reference runs."""
from __future__ import annotations

from pathlib import Path

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams

# Forkserver children fork from one process that imported these once, not one import per rank.
PRELOAD = ["moebus.engine.distributed", "torch._dynamo"]
ENGINE_KWARGS = {"num_kv_blocks": 96, "max_model_len": 512}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(n: int, seed: int, vocab: list[int] | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if vocab is None:
        return torch.randint(0, 512, (n,), generator=g).tolist()
    return [vocab[i] for i in torch.randint(0, len(vocab), (n,), generator=g).tolist()]


def reference_tokens(ckpt: Path, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Greedy tokens of (id, prompt, max_tokens) requests on one single-process engine."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), **{**ENGINE_KWARGS, "num_kv_blocks": 512}))
    for rid, ids, n in requests:
        engine.add_request(rid, ids, greedy(n))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out
