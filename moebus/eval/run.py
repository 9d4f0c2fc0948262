"""One evaluation run: inputs and the HF fp32 reference once, then each configuration against it.

The quality-gate tests call the same functions (`prepare`, `evaluate_engine`, `evaluate_hf`) on
a smaller Settings.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moebus.engine.llm import LLM
from moebus.eval import candidate, reference
from moebus.eval.configs import ALONE, BATCHED, CONFIGS, HF_BF16, EvalConfig
from moebus.eval.metrics import GreedyStats, PerplexityStats, greedy_stats
from moebus.eval.reference import Reference
from moebus.eval.text import DEFAULT_PROMPTS, DEFAULT_TEXT, Chunk, chunks, read_prompts, read_text


class EvalError(Exception):
    """A bad input or a model that does not load: the CLI prints it as one line."""


@dataclass(frozen=True, slots=True)
class Settings:
    model: str = "smollm2"
    text: Path = DEFAULT_TEXT
    prompts: Path = DEFAULT_PROMPTS
    ctx: int = 512
    max_chunks: int | None = None
    max_prompts: int | None = None
    max_tokens: int = 24
    tie_margin: float = 0.01


@dataclass(slots=True)
class Result:
    name: str
    description: str
    mode: str
    scored_by: str  # how the text's logits were computed
    ppl: PerplexityStats
    greedy: GreedyStats
    seconds: float


def prepare(s: Settings) -> tuple[Reference, Path]:
    """Tokenize the text and prompts, load HF fp32 and compute its references; the HF dir too."""
    from moebus.engine.tokenizer import load_tokenizer

    for what, path in (("text", s.text), ("prompts", s.prompts)):
        if not Path(path).is_file():
            raise EvalError(f"{what} file not found: {path}")
    hf_path: Path = _load(f"model {s.model}", reference.hf_dir, s.model)
    tok = _load(f"the tokenizer of {s.model}", load_tokenizer, s.model)
    try:
        text_chunks = chunks(tok.encode(read_text(s.text)), s.ctx, s.max_chunks)
    except ValueError as e:
        raise EvalError(str(e)) from e
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in read_prompts(s.prompts)[:s.max_prompts]]
    model = _load(f"HF fp32 ({hf_path})", reference.load_hf, hf_path, torch.float32)
    ref = reference.build_reference(model, text_chunks, prompts, s.max_tokens)
    del model
    gc.collect()
    return ref, hf_path


def score(ref: Reference, logits_of: Callable[[Chunk], torch.Tensor]) -> PerplexityStats:
    stats = PerplexityStats()
    for chunk, ref_logits in zip(ref.chunks, ref.chunk_logits, strict=True):
        stats.add(logits_of(chunk), torch.tensor(chunk.targets), ref_logits)
    return stats


def evaluate_engine(llm: LLM, ref: Reference, batched: bool,
                    tie_margin: float) -> tuple[PerplexityStats, GreedyStats]:
    stats = score(ref, lambda c: candidate.decode_logits(llm, c))
    tokens = candidate.generate_greedy(llm, ref.prompts, ref.max_tokens, batched)
    return stats, greedy_stats(ref.tokens, ref.path_logits, tokens, tie_margin)


def evaluate_hf(model: torch.nn.Module, ref: Reference, tie_margin: float) -> tuple[PerplexityStats, GreedyStats]:
    stats = score(ref, lambda c: reference.chunk_logits(model, c))
    tokens = [reference.greedy(model, p, ref.max_tokens) for p in ref.prompts]
    return stats, greedy_stats(ref.tokens, ref.path_logits, tokens, tie_margin)


def run_configs(s: Settings, ref: Reference, hf_path: Path, names: list[str]) -> Iterator[Result]:
    """Each named configuration in turn, one engine alive at a time."""
    for name in names:
        t0 = time.perf_counter()
        if name == HF_BF16:
            model = _load("HF bf16", reference.load_hf, hf_path, torch.bfloat16)
            stats, greedy = evaluate_hf(model, ref, s.tie_margin)
            desc, mode, how = "HF transformers, bfloat16 (the yardstick)", ALONE, "one forward a chunk"
        else:
            cfg: EvalConfig = CONFIGS[name]
            model = _load(f"the engine for {name}", LLM, s.model, **cfg.engine_kwargs)
            stats, greedy = evaluate_engine(model, ref, cfg.mode == BATCHED, s.tie_margin)
            model.engine.close()
            desc, mode, how = cfg.description, cfg.mode, "decode steps"
        del model
        gc.collect()
        yield Result(name, desc, mode, how, stats, greedy, time.perf_counter() - t0)


def _load(what: str, load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return load(*args, **kwargs)
    except FileNotFoundError as e:  # its message names the path
        raise EvalError(str(e)) from e
    except Exception as e:  # any loader failure becomes one line of the CLI, not a traceback
        raise EvalError(f"could not load {what}: {type(e).__name__}: {e}") from e
