"""The named engine configurations `moebus eval --config NAME` measures (torch-free: the CLI
parser lists them without loading anything)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ALONE, BATCHED = "alone", "batched"  # greedy generation: one generate call per prompt, or one for all
HF_BF16 = "hf-bf16"  # HF transformers in bf16: the yardstick every run reports beside the engine


@dataclass(frozen=True, slots=True)
class EvalConfig:
    name: str
    engine_kwargs: Mapping[str, object] = field(default_factory=dict)  # LLM(model, **engine_kwargs)
    mode: str = ALONE
    description: str = ""


_FP32, _BF16 = {"dtype": "float32"}, {"dtype": "bfloat16"}
_GGUF = {"weight_format": "gguf", "dtype": "float32"}

CONFIGS: dict[str, EvalConfig] = {c.name: c for c in (
    EvalConfig("fp32", _FP32, ALONE, "dense weights, float32"),
    EvalConfig("bf16", _BF16, ALONE, "dense weights, bfloat16"),
    EvalConfig("auto", {"dtype": "auto"}, ALONE, "dtype auto: what `moebus` picks on this CPU"),
    EvalConfig("gguf16", {**_GGUF, "gguf_activation_bits": 16}, ALONE,
               "GGUF blocks, float32, decode activations quantized to 16 bits"),
    EvalConfig("gguf8", {**_GGUF, "gguf_activation_bits": 8}, ALONE,
               "GGUF blocks, float32, decode activations quantized to 8 bits (as llama.cpp)"),
    EvalConfig("ngram", {**_FP32, "num_speculative_tokens": 3}, ALONE, "float32, n-gram drafts (3 a step)"),
    EvalConfig("ngram-bf16", {**_BF16, "num_speculative_tokens": 3}, ALONE, "bfloat16, n-gram drafts (3 a step)"),
    EvalConfig("batched", _FP32, BATCHED, "float32, all prompts in one generate call"),
    EvalConfig("batched-bf16", _BF16, BATCHED, "bfloat16, all prompts in one generate call"),
    EvalConfig("deterministic", {**_BF16, "deterministic": True}, BATCHED,
               "bfloat16, batch-invariant kernels, all prompts in one call"),
)}

DEFAULT = ("fp32", "bf16")
NAMES = (*CONFIGS, HF_BF16)
