"""A tiny DeepSeek-V4 checkpoint that an `LLMEngine` can serve: HF weights plus a word-level
tokenizer.json (token i spells `<i>`), for EP tests and CPU benchmarks."""
from __future__ import annotations

from pathlib import Path

from moebus.engine.models.hf_checkpoint import tiny_deepseek_v4_config, write_tiny_deepseek_v4
from moebus.engine.models.tiny_checkpoints import write_word_tokenizer


def write_tiny_moe_checkpoint(out_dir: str | Path, seed: int = 0, **overrides: object) -> Path:
    path = write_tiny_deepseek_v4(out_dir, seed, **overrides)
    write_word_tokenizer(path, int(tiny_deepseek_v4_config(**overrides)["vocab_size"]))
    return path
