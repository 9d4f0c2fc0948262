"""Build the engine a worker runs, and translate wire sampling options into its parameters."""
from __future__ import annotations

from typing import Any

from moebus.shared.messages import SamplingOptions
from moebus.shared.toy_model import TOY_MODEL, ToyEngine, ToyEngineConfig

from .config import WorkerConfig


def make_engine(cfg: WorkerConfig) -> Any:
    if cfg.model == TOY_MODEL:
        return ToyEngine(ToyEngineConfig(**cfg.engine))
    import torch  # torch lives behind this import

    from moebus.engine.llm_engine import EngineConfig, LLMEngine

    if cfg.torch_threads:  # few shared cores: one intra-op thread runs a small model several times faster
        torch.set_num_threads(cfg.torch_threads)
    return LLMEngine(EngineConfig(model=cfg.model, **cfg.engine))


def choice_params(opts: SamplingOptions, index: int, toy: bool) -> Any:
    """Engine parameters of choice `index` (n > 1 runs n engine requests; each gets its own seed)."""
    fields = opts.model_dump(exclude={"n", "structured"})
    if opts.seed is not None:
        fields["seed"] = opts.seed + index
    if toy:  # the toy engine reads attributes only; keep it torch-free
        return opts.model_copy(update={"n": 1, "seed": fields["seed"]})
    from moebus.engine.sampling.params import SamplingParams, StructuredOutputParams

    structured = StructuredOutputParams(**opts.structured.model_dump()) if opts.structured else None
    return SamplingParams(n=1, structured=structured, **fields)
