"""Seeded random token ids: the text and prompts for a tiny random model (--model tiny-v4).

A random model has no language to score, and the tiny V4's word-level tokenizer spells token i as
`<i>`, so English would be mostly unknown words. Uniform ids over the vocabulary exercise the same
paths: every position of every chunk scored, and prompts of 4..80 tokens, most longer than the
tiny V4's 16-token sliding window.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT_TOKENS = 2048  # 4 chunks at the default --ctx 512
NUM_PROMPTS = 16
PROMPT_LENGTHS = (4, 80)  # inclusive range


def vocab_size(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def text_ids(vocab: int, n: int = TEXT_TOKENS, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt_ids(vocab: int, count: int = NUM_PROMPTS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = PROMPT_LENGTHS
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def describe(num_text_tokens: int, num_prompts: int) -> str:
    """The table header's note: these are not the English text and prompt set."""
    lo, hi = PROMPT_LENGTHS
    return (f"inputs: seeded synthetic token ids, not the English text ({num_text_tokens}-token text; "
            f"{num_prompts} prompts of {lo}..{hi} ids)")
