"""A tiny DeepSeek-V4 checkpoint that an `LLMEngine` can serve: HF weights plus a word-level
tokenizer.json (token i spells `<i>`), for EP tests and CPU benchmarks."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from moebus.engine.models.hf_checkpoint import tiny_deepseek_v4_config, write_tiny_deepseek_v4


def write_tiny_moe_checkpoint(out_dir: str | Path, seed: int = 0, **overrides: object) -> Path:
    path = write_tiny_deepseek_v4(out_dir, seed, **overrides)
    vocab_size = int(tiny_deepseek_v4_config(**overrides)["vocab_size"])
    tok = HFTokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.save(str(path / "tokenizer.json"))
    return path
