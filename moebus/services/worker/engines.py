"""Build the engine a worker runs, and translate wire sampling options into its parameters."""
from __future__ import annotations

from typing import Any

from moebus.devmodel.toy import TOY_MODEL, ToyEngine, ToyEngineConfig
from moebus.engine.port import EnginePort
from moebus.shared.messages import SamplingOptions

from .config import WorkerConfig


def make_engine(cfg: WorkerConfig) -> EnginePort:
    if cfg.model == TOY_MODEL:
        return ToyEngine(ToyEngineConfig(**cfg.engine))
    import torch  # torch lives behind this import

    from moebus.engine.llm_engine import EngineConfig, LLMEngine

    if cfg.torch_threads:  # few shared cores: one intra-op thread runs a small model several times faster
        torch.set_num_threads(cfg.torch_threads)
    return LLMEngine(EngineConfig(model=cfg.model, **cfg.engine))


def engine_params(opts: SamplingOptions, toy: bool) -> Any:
    """Engine parameters of a request, all n choices (the engine fans out: choice i seeded seed + i).
    Raises ValueError for values the engine refuses."""
    if toy:  # the toy engine reads attributes only; keep it torch-free
        return opts
    from moebus.engine.sampling.params import SamplingParams, StructuredOutputParams

    structured = StructuredOutputParams(**opts.structured.model_dump()) if opts.structured else None
    return SamplingParams(structured=structured, **opts.model_dump(exclude={"structured"}))
