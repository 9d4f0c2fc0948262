"""Sampling: request parameters, the batched sampler, logits processors, structured output, spec decode."""
from .batch import SamplingBatch, make_generator
from .grammar_state import GrammarState, apply_bitmask, bitmask_to_bool
from .params import SamplingParams, StructuredOutputParams
from .sampler import LogprobsTensors, Sampler, SamplerOutput
from .spec_decode import DraftModelProposer, NgramProposer, SpecDecodeStats, rejection_sample
from .structured import Grammar, StructuredOutputCompiler, StructuredOutputConfig

__all__ = [
    "SamplingParams",
    "StructuredOutputParams",
    "SamplingBatch",
    "make_generator",
    "Sampler",
    "SamplerOutput",
    "LogprobsTensors",
    "NgramProposer",
    "DraftModelProposer",
    "SpecDecodeStats",
    "rejection_sample",
    "StructuredOutputCompiler",
    "StructuredOutputConfig",
    "Grammar",
    "GrammarState",
    "apply_bitmask",
    "bitmask_to_bool",
]
