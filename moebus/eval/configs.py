"""The named engine configurations `moebus eval --config NAME` measures (torch-free: the CLI
parser lists them without loading anything)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# How a row generates its greedy tokens (run.py dispatches on it):
ALONE, BATCHED = "alone", "batched"  # one LLM: one generate call per prompt, or one for all
DISAGG = "disagg"  # a prefill LLM samples the first token, its KV moves to a decode LLM (disagg.py)
EP2 = "ep2"  # an expert-parallel group of 2 gloo ranks, prompts split between them (ep.py)
MODES = (ALONE, BATCHED, DISAGG, EP2)

HF_BF16 = "hf-bf16"  # HF transformers in bf16: the yardstick every run reports beside the engine
TINY_V4 = "tiny-v4"  # --model: a tiny random DeepSeek-V4 written for the run (tiny_v4.py)


@dataclass(frozen=True, slots=True)
class EvalConfig:
    name: str
    engine_kwargs: Mapping[str, object] = field(default_factory=dict)  # LLM(model, **engine_kwargs)
    mode: str = ALONE
    description: str = ""
    model: str | None = None  # the --model the row needs (None: any)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")


_FP32, _BF16 = {"dtype": "float32"}, {"dtype": "bfloat16"}
_GGUF = {"weight_format": "gguf", "dtype": "float32"}
_MTP = {**_FP32, "speculative_method": "mtp", "num_speculative_tokens": 3}

CONFIGS: dict[str, EvalConfig] = {c.name: c for c in (
    EvalConfig("fp32", _FP32, ALONE, "dense weights, float32"),
    EvalConfig("bf16", _BF16, ALONE, "dense weights, bfloat16"),
    EvalConfig("auto", {"dtype": "auto", "weight_format": "auto"}, ALONE,
               "dtype and weight format auto: what `moebus` picks on this CPU"),
    EvalConfig("gguf16", {**_GGUF, "gguf_activation_bits": 16}, ALONE,
               "GGUF blocks, float32, activations quantized to 16 bits (every row count on AVX-512's panels)"),
    EvalConfig("batched-gguf16", {**_GGUF, "gguf_activation_bits": 16}, BATCHED,
               "GGUF blocks, 16-bit activations, all prompts in one generate call"),
    EvalConfig("gguf8", {**_GGUF, "gguf_activation_bits": 8}, ALONE,
               "GGUF blocks, float32, decode activations quantized to 8 bits (as llama.cpp)"),
    EvalConfig("ngram", {**_FP32, "num_speculative_tokens": 3}, ALONE, "float32, n-gram drafts (3 a step)"),
    EvalConfig("ngram-bf16", {**_BF16, "num_speculative_tokens": 3}, ALONE, "bfloat16, n-gram drafts (3 a step)"),
    EvalConfig("batched", _FP32, BATCHED, "float32, all prompts in one generate call"),
    EvalConfig("batched-bf16", _BF16, BATCHED, "bfloat16, all prompts in one generate call"),
    EvalConfig("deterministic", {**_BF16, "deterministic": True}, BATCHED,
               "bfloat16, batch-invariant kernels, all prompts in one call"),
    EvalConfig("disagg", _FP32, DISAGG, "float32, prefill engine -> KV transfer -> decode engine"),
    EvalConfig("disagg-bf16", _BF16, DISAGG, "bfloat16, prefill engine -> KV transfer -> decode engine"),
    EvalConfig("v4", _FP32, ALONE, "tiny DeepSeek-V4, float32, no speculation", TINY_V4),
    EvalConfig("v4-mtp", _MTP, ALONE, "tiny DeepSeek-V4, float32, MTP drafts (3 a step; random nextn layer: few accepted)", TINY_V4),
    EvalConfig("v4-ep2", _FP32, EP2, "tiny DeepSeek-V4, float32, expert parallel over 2 gloo ranks", TINY_V4),
)}

DEFAULT = ("fp32", "bf16")
NAMES = (*CONFIGS, HF_BF16)
