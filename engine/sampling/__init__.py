"""Sampling: request parameters, the batched sampler, logits processors, structured output, spec decode."""
from .params import SamplingParams, StructuredOutputParams

__all__ = ["SamplingParams", "StructuredOutputParams"]
