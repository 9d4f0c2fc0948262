"""Incremental detokenization: the engine's stateful `IncrementalDetokenizer` and the tokenizer
service's stateless `decode_step`.

Decoding each token alone breaks multi-byte characters and BPE merges, so we decode a short window
(prefix_offset:) and emit only the text past read_offset once it no longer ends in a partial
UTF-8 character (U+FFFD). Stop strings: moebus.text.stop_strings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SkippingDecoder(Protocol):
    """What IncrementalDetokenizer needs of its tokenizer (tokenizer.Tokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

_WINDOW = 6  # tokens of left context re-decoded so merges at the boundary come out right


@dataclass
class IncrementalDetokenizer:
    tokenizer: SkippingDecoder
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_ids[-_WINDOW:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _WINDOW, 0)

    def push(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty)."""
        out = []
        for tid in new_ids:
            self.ids.append(tid)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
            full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return "".join(out)


# Stateless: the caller (the tokenizer service, for the frontend) keeps a small window of ids and
# two offsets. Decoding a window with some left context (ids already turned into text) and diffing
# against the context's own text gives the new text, right even when a token's text depends on its
# neighbours (leading spaces, byte-fallback pieces). A window that ends inside a UTF-8 character
# decodes to U+FFFD: release nothing and wait for the next token.

class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def decode_step(tok: Decoder, ids: list[int], read_offset: int, skip_ids: frozenset[int],
                finished: bool = False) -> tuple[str, int, int]:
    """Returns (new text, new prefix offset, new read offset), offsets relative to `ids`."""
    kept = [i for i in ids if i not in skip_ids]
    n_read = sum(1 for i in ids[:read_offset] if i not in skip_ids)
    context = tok.decode(kept[:n_read]) if n_read else ""
    text = tok.decode(kept)
    if (text.endswith("\ufffd") and not finished) or len(text) < len(context):
        return "", 0, read_offset
    return text[len(context):], read_offset, len(ids)
