"""One evaluation run: inputs and the HF fp32 reference once, then each configuration against it.

A configuration's mode (configs.py) says how its greedy tokens are generated and its text scored:
one engine (`alone`, `batched`), a prefill and a decode engine (`disagg`, disagg.py), or an
expert-parallel group of processes (`ep2`, ep.py). The quality-gate tests call the same functions
(`prepare`, `run_configs`) on a smaller Settings.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moebus.engine.llm import LLM
from moebus.eval import candidate, disagg, ep, reference, synthetic
from moebus.eval.configs import ALONE, BATCHED, CONFIGS, DISAGG, EP2, HF_BF16, EvalConfig
from moebus.eval.metrics import GreedyStats, PerplexityStats, greedy_stats
from moebus.eval.reference import Reference
from moebus.eval.text import DEFAULT_PROMPTS, DEFAULT_TEXT, chunks, read_prompts, read_text


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
    synthetic: bool = False  # seeded token ids (synthetic.py) instead of text and prompts


@dataclass(slots=True)
class Result:
    name: str
    description: str
    mode: str
    scored_by: str  # how the text's logits were computed
    ppl: PerplexityStats
    greedy: GreedyStats
    seconds: float
    tokens: list[list[int]] = field(default_factory=list)  # greedy tokens per prompt
    counters: dict[str, int] = field(default_factory=dict)  # what the mode did: drafts, KV moved


@dataclass(slots=True)
class Measured:
    """What a mode hands back, before the comparison with the reference."""

    ppl: PerplexityStats
    tokens: list[list[int]]
    scored_by: str
    counters: dict[str, int] = field(default_factory=dict)


def prepare(s: Settings) -> tuple[Reference, Path]:
    """Tokenize the text and prompts, load HF fp32 and compute its references; the HF dir too."""
    if not s.synthetic:
        for what, path in (("text", s.text), ("prompts", s.prompts)):
            if not Path(path).is_file():
                raise EvalError(f"{what} file not found: {path}")
    hf_path: Path = _load(f"model {s.model}", reference.hf_dir, s.model)
    ids, prompts = _synthetic_inputs(hf_path) if s.synthetic else _text_inputs(s)
    try:
        text_chunks = chunks(ids, s.ctx, s.max_chunks)
    except ValueError as e:
        raise EvalError(str(e)) from e
    model = _load(f"HF fp32 ({hf_path})", reference.load_hf, hf_path, torch.float32)
    ref = reference.build_reference(model, text_chunks, prompts[:s.max_prompts], s.max_tokens)
    del model
    gc.collect()
    return ref, hf_path


def _text_inputs(s: Settings) -> tuple[list[int], list[list[int]]]:
    from moebus.text.tokenizer import load_tokenizer

    tok = _load(f"the tokenizer of {s.model}", load_tokenizer, s.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in read_prompts(s.prompts)]
    return tok.encode(read_text(s.text)), prompts


def _synthetic_inputs(hf_path: Path) -> tuple[list[int], list[list[int]]]:
    vocab = synthetic.vocab_size(hf_path)
    return synthetic.text_ids(vocab), synthetic.prompt_ids(vocab)


def score(ref: Reference, logits: Iterable[torch.Tensor]) -> PerplexityStats:
    """logits: per reference chunk, the candidate's scored rows (a generator computes them lazily)."""
    stats = PerplexityStats()
    for chunk, ref_logits, lg in zip(ref.chunks, ref.chunk_logits, logits, strict=True):
        stats.add(lg, torch.tensor(chunk.targets), ref_logits)
    return stats


def measure_hf(model: torch.nn.Module, ref: Reference) -> Measured:
    stats = score(ref, (reference.chunk_logits(model, c) for c in ref.chunks))
    return Measured(stats, [reference.greedy(model, p, ref.max_tokens) for p in ref.prompts], "one forward a chunk")


def measure(s: Settings, ref: Reference, cfg: EvalConfig) -> Measured:
    if cfg.mode in (ALONE, BATCHED):
        return _one_engine(s, ref, cfg)
    if cfg.mode == DISAGG:
        return _disaggregated(s, ref, cfg)
    if cfg.mode == EP2:
        return _expert_parallel(s, ref, cfg)
    raise ValueError(f"unknown mode {cfg.mode!r}")


def _one_engine(s: Settings, ref: Reference, cfg: EvalConfig) -> Measured:
    llm = _load(f"the engine for {cfg.name}", LLM, s.model, **cfg.engine_kwargs)
    try:
        stats = score(ref, (candidate.decode_logits(llm.engine, c) for c in ref.chunks))
        tokens = candidate.generate_greedy(llm, ref.prompts, ref.max_tokens, cfg.mode == BATCHED)
        return Measured(stats, tokens, "decode steps", candidate.spec_counters(llm.engine))
    finally:
        llm.engine.close()


def _disaggregated(s: Settings, ref: Reference, cfg: EvalConfig) -> Measured:
    pre = _load(f"the prefill engine for {cfg.name}", disagg.prefill_engine, s.model, cfg.engine_kwargs)
    try:
        dec = _load(f"the decode engine for {cfg.name}", disagg.decode_engine, s.model, cfg.engine_kwargs)
        try:
            tokens, moved = disagg.generate(pre, dec, ref.prompts, ref.max_tokens)
            stats = score(ref, (candidate.decode_logits(dec, c) for c in ref.chunks))
            return Measured(stats, tokens, "decode steps on the decode engine", moved)
        finally:
            dec.close()
    finally:
        pre.close()


def _expert_parallel(s: Settings, ref: Reference, cfg: EvalConfig) -> Measured:
    g = ep.run_group(s.model, cfg.engine_kwargs, ref.chunks, ref.prompts, ref.max_tokens)
    how = f"decode steps on the EP group (chunks split between its {ep.WORLD} ranks)"
    return Measured(score(ref, g.logits), g.tokens, how, g.counters)


def run_configs(s: Settings, ref: Reference, hf_path: Path, names: list[str]) -> Iterator[Result]:
    """Each named configuration in turn, one engine (or EP group) alive at a time."""
    for name in names:
        t0 = time.perf_counter()
        if name == HF_BF16:
            model = _load("HF bf16", reference.load_hf, hf_path, torch.bfloat16)
            m, desc, mode = measure_hf(model, ref), "HF transformers, bfloat16 (the yardstick)", ALONE
            del model
        else:
            cfg = CONFIGS[name]
            m, desc, mode = measure(s, ref, cfg), cfg.description, cfg.mode
        gc.collect()
        greedy = greedy_stats(ref.tokens, ref.path_logits, m.tokens, s.tie_margin)
        yield Result(name, desc, mode, m.scored_by, m.ppl, greedy, time.perf_counter() - t0, m.tokens, m.counters)


def _load(what: str, load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return load(*args, **kwargs)
    except FileNotFoundError as e:  # its message names the path
        raise EvalError(str(e)) from e
    except Exception as e:  # any loader failure becomes one line of the CLI, not a traceback
        raise EvalError(f"could not load {what}: {type(e).__name__}: {e}") from e
