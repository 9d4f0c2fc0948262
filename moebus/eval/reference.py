"""HF transformers on the engine's weights: the reference (fp32) and the yardstick (bf16).

Greedy decoding here is a plain loop rather than `generate`: the engine's `ignore_eos` neither
stops at EOS nor bans it, while `generate(min_new_tokens=N)` bans it (a forced divergence wherever
an answer ends early) and `generate` also applies the checkpoint's generation_config defaults
(e.g. a repetition penalty).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moebus.eval.metrics import PerplexityStats
from moebus.eval.text import Chunk


def hf_dir(model: str) -> Path:
    """The HF-layout directory of the engine's `model` (a GGUF is converted once, cached)."""
    from moebus.engine.loader.gguf_cache import converted_dir
    from moebus.engine.models import resolve

    path = resolve(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model not found: {model}")
        return converted_dir(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model not found: {model} (expected smollm2, a .gguf file or a dir with config.json)")
    return path


def load_hf(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.inference_mode()
def chunk_logits(model: torch.nn.Module, chunk: Chunk) -> torch.Tensor:
    """float32 [len(targets), V]: one forward of the whole chunk, the scored rows (the LM head only
    on the last rows: logits_to_keep)."""
    logits = model(torch.tensor([chunk.tokens]), logits_to_keep=len(chunk.targets) + 1).logits[0]
    return logits[:-1].float()


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens; EOS is an ordinary token (neither stops nor is banned)."""
    from transformers import DynamicCache

    # The cache goes in 4th, positionally: transformers 4.x names that argument past_key_values, 5.x cache.
    cache = DynamicCache()
    logits = model(torch.tensor([prompt]), None, None, cache, use_cache=True, logits_to_keep=1).logits
    tokens: list[int] = []
    while True:
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) == n:
            return tokens
        logits = model(torch.tensor([tokens[-1:]]), None, None, cache, use_cache=True).logits


@torch.inference_mode()
def path_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens), V]: row i = the logits that chose tokens[i], from one forward."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1:].float()


@dataclass(slots=True)
class Reference:
    """HF fp32's results, computed once a run and shared by every configuration."""

    chunks: list[Chunk]
    chunk_logits: list[torch.Tensor]  # per chunk, the scored rows
    prompts: list[list[int]]  # chat-templated prompt ids
    max_tokens: int  # greedy tokens per prompt
    tokens: list[list[int]]  # greedy continuation of each prompt
    path_logits: list[torch.Tensor]  # per prompt [len(tokens), V] along its own greedy path
    stats: PerplexityStats  # the reference's own NLL / PPL


def build_reference(model: torch.nn.Module, chunks: list[Chunk], prompts: list[list[int]],
                    max_tokens: int) -> Reference:
    logits = [chunk_logits(model, c) for c in chunks]
    stats = PerplexityStats()
    for c, lg in zip(chunks, logits, strict=True):
        stats.add(lg, torch.tensor(c.targets))
    tokens = [greedy(model, p, max_tokens) for p in prompts]
    paths = [path_logits(model, p, t) for p, t in zip(prompts, tokens, strict=True)]
    return Reference(chunks, logits, prompts, max_tokens, tokens, paths, stats)
