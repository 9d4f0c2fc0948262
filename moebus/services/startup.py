"""What `moebus up` does before the services start, said phase by phase instead of minutes of silence.

1. model: a GGUF is converted once into the cache (a progress bar per tensor), so the workers load
   the converted copy in about a second instead of each converting it;
2. kernels: the C kernels are compiled once into the cache (each worker would otherwise compile
   on its first forward);
3. (the launcher) processes start; 4. warm-up: each worker runs a warm-up generation before it
   reports ready, and the launcher names the processes it is still waiting for.
The toy model needs none of it. `./run` says when it installs (phase 0).
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from moebus.devmodel.toy import TOY_MODEL
from moebus.platforms.cpu.cores import usable_cores

Say = Callable[[str], None]


def say_to(stream: TextIO = sys.stderr) -> Say:
    def say(line: str) -> None:
        print(f"moebus up: {line}", file=stream, flush=True)

    return say


def prepare_model(model: str, say: Say) -> None:
    """Phase 1: convert a GGUF model into the cache (nothing to do for a checkpoint directory)."""
    if model == TOY_MODEL:
        return
    from tqdm import tqdm

    from moebus.engine.loader.gguf_cache import converted_dir
    from moebus.engine.models import resolve

    path = resolve(model)
    if path.suffix != ".gguf":
        say(f"[1/4] model: {path} (a checkpoint directory, nothing to convert)")
        return
    say(f"[1/4] model: {path.name}, converted once into the cache")
    started, bar = time.monotonic(), None

    def progress(done: int, total: int) -> None:  # called only while converting
        nonlocal bar
        if bar is None:
            bar = tqdm(desc="moebus up: converting", total=total, unit="tensor", file=sys.stderr)
        bar.update(done - bar.n)

    try:
        out = converted_dir(path, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    took = time.monotonic() - started
    say(f"[1/4] model: converted into {out} in {took:.1f}s" if bar is not None else
        f"[1/4] model: already converted ({out})")


def build_kernels(model: str, say: Say) -> None:
    """Phase 2: compile every C kernel into the cache (a cached build is found in milliseconds)."""
    if model == TOY_MODEL:
        return
    from moebus.kernels import cpu_build

    sources = sorted(p.name for p in Path(cpu_build.__file__).with_name("csrc").glob("*.c"))
    say(f"[2/4] kernels: compiling {len(sources)} C kernels (cached after the first start)")
    started, failed = time.monotonic(), []
    for source in sources:
        if cpu_build.build(source) is None:
            failed.append(source)
    took = time.monotonic() - started
    if failed:
        say(f"[2/4] kernels: {len(failed)} could not be built ({', '.join(failed)}): the torch reference "
            f"runs instead ({took:.1f}s)")
    else:
        say(f"[2/4] kernels: ready in {took:.1f}s")


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """What a user needs to know about the served model, said at start."""

    architecture: str
    trained_context: int | None  # the checkpoint's max_position_embeddings
    context: int  # the engines' max_model_len
    dtype: str  # the compute dtype on this host ("auto" resolved)
    weight_format: str = "dense"  # "dense" or "gguf" ("auto" resolved)

    def __str__(self) -> str:
        trained = "" if self.trained_context in (None, self.context) else f" of {self.trained_context} trained"
        blocks = ", on the GGUF's quantized blocks" if self.weight_format == "gguf" else ""
        return f"{self.architecture}, context {self.context} tokens{trained}, {self.dtype}{blocks}"


def summarize_model(model: str, engine: dict) -> ModelSummary:
    """From the checkpoint's config.json (a GGUF's converted copy) and the workers' engine options.
    Without an explicit max_model_len the engines serve the checkpoint's trained context, capped at
    EngineConfig's default."""
    from moebus.engine.config import EngineConfig
    from moebus.engine.loader.gguf_cache import converted_dir
    from moebus.engine.models import resolve
    from moebus.platforms.dtype_choice import resolve_dtype
    from moebus.platforms.format_choice import choose_format

    path = resolve(model)
    cfg = json.loads(((converted_dir(path) if path.suffix == ".gguf" else path) / "config.json").read_text())
    trained = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    default = EngineConfig.__dataclass_fields__["max_model_len"].default
    context = engine.get("max_model_len") or min(default, trained or default)
    fmt = choose_format(path, str(engine.get("weight_format", "dense")), str(engine.get("dtype", "auto")))
    return ModelSummary((cfg.get("architectures") or ["?"])[0], trained, int(context), resolve_dtype(fmt.dtype),
                        fmt.weight_format)


def takes_images(model: str) -> bool:
    """Whether `model` is a vision-language checkpoint folder: its config.json has a `vision_config`,
    as every HF VLM's does (SmolVLM / Idefics3 here). Read without torch. The embedded model, the toy
    and a GGUF are text only (llama.cpp keeps a VLM's vision tower apart, in an mmproj file)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "vision_config" in cfg


def prepare(model: str, say: Say, engine: dict) -> ModelSummary | None:
    """Phases 1 and 2; the served model's summary (None for the toy model)."""
    prepare_model(model, say)
    build_kernels(model, say)
    if model == TOY_MODEL:
        return None
    summary = summarize_model(model, engine)
    say(f"model {model}: {summary}")
    return summary


def threads_per_worker(workers: int) -> int | None:
    """Torch threads for each of `workers` engine processes on this machine: its usable cores split
    between them (at least one each), so they do not oversubscribe the cores; None for one worker
    (torch's own default)."""
    if workers <= 1:
        return None
    return max(1, usable_cores() // workers)


class WaitReporter:
    """Phase 4: every `every_s`, which processes are still starting up (loading, warming up)."""

    def __init__(self, say: Say, every_s: float = 10.0) -> None:
        self.say, self.every_s = say, every_s
        self._started = time.monotonic()
        self._last = self._started

    def __call__(self, pending: list[str]) -> None:
        now = time.monotonic()
        if pending and now - self._last >= self.every_s:
            self._last = now
            self.say(f"[4/4] warm-up: {now - self._started:.0f}s, waiting for {', '.join(sorted(pending))}")

