"""Prompts of an exact token count for the target's tokenizer, with exactly shared prefixes.

The prompt is a run of "pieces", each one token on its own and still one token next to any other
piece (" word" pieces for byte-level BPE, whose pre-tokenizer splits at each space; single
letters for the byte-level toy tokenizer), so n pieces are n tokens. A hash id stands for one
prefix block of `block_tokens` pieces drawn from a generator seeded by the id: requests sharing
ids share exactly those blocks. Without hash ids each prompt is its own random run (no sharing),
unless a common prefix of `shared_prefix_tokens` is asked for. Every prompt is checked by encoding.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Any

from .trace import BLOCK_TOKENS, TraceRequest

_WORD = re.compile(r"^ [a-z]{2,10}$")
_LETTER = re.compile(r"^[a-z]$")


def load_tokenizer(name: str) -> Any:
    """"toy" (moebus.devmodel), "smollm2" (the embedded GGUF), a .gguf file or an HF dir with tokenizer.json."""
    if name == "toy":
        from moebus.devmodel.toy import ToyTokenizer

        return ToyTokenizer()
    from moebus.text.tokenizer import load_tokenizer as engine_load

    return engine_load(name)


def one_token_pieces(tok: Any) -> list[str]:
    """Strings that encode to exactly one token and concatenate without merging."""
    words, letters = [], []
    for i in range(min(tok.vocab_size, 1 << 17)):
        s = tok.decode([i])
        if _WORD.match(s) and _encode(tok, s) == [i]:
            words.append(s)
        elif _LETTER.match(s) and _encode(tok, s) == [i]:
            letters.append(s)
    if len(words) >= 256:
        return words
    if len(letters) == 26:
        return letters
    raise ValueError("this tokenizer has no one-token pieces to build exact prompts from")


def _encode(tok: Any, text: str) -> list[int]:
    try:
        return tok.encode(text, add_special_tokens=False)
    except TypeError:  # the toy tokenizer adds none anyway
        return tok.encode(text)


class PromptSynth:
    def __init__(self, tok: Any, block_tokens: int = BLOCK_TOKENS, seed: int = 0,
                 shared_prefix_tokens: int = 0) -> None:
        self.tok = tok
        self.block_tokens = block_tokens
        self.seed = seed
        self.pieces = one_token_pieces(tok)
        self.overhead = len(tok.encode(""))  # BOS added by encode, if any
        self.shared = self._run(random.Random(f"{seed}:shared"), shared_prefix_tokens)
        self._block = lru_cache(maxsize=65536)(self._make_block)

    def _run(self, rng: random.Random, n: int) -> list[str]:
        return rng.choices(self.pieces, k=n)

    def _make_block(self, hash_id: int) -> tuple[str, ...]:
        return tuple(self._run(random.Random(f"{self.seed}:block:{hash_id}"), self.block_tokens))

    def pieces_for(self, req: TraceRequest, index: int) -> list[str]:
        n = max(1, req.input_tokens - self.overhead)
        out = list(self.shared[:n])
        for h in req.hash_ids:
            if len(out) >= n:
                break
            out += self._block(h)
        if len(out) < n:
            out += self._run(random.Random(f"{self.seed}:own:{index}"), n - len(out))
        return out[:n]

    def prompt(self, req: TraceRequest, index: int) -> str:
        """The prompt text for the trace's `index`-th request; its token count is checked."""
        text = "".join(self.pieces_for(req, index))
        n = len(self.tok.encode(text))
        if n != max(req.input_tokens, 1 + self.overhead):
            raise ValueError(f"prompt synthesis gave {n} tokens, wanted {req.input_tokens}")
        return text

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))
