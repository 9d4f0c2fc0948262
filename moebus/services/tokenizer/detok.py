"""Stateless incremental detokenization: the caller keeps a small window of ids and two offsets.

Decoding a window with some left context (ids already turned into text) and diffing against the
context's own text gives the new text, right even when a token's text depends on its neighbours
(leading spaces, byte-fallback pieces). A window that ends inside a UTF-8 character decodes to
U+FFFD: release nothing and wait for the next token.
"""
from __future__ import annotations

from typing import Protocol


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
