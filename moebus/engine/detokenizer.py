"""Incremental detokenization and stop-string matching across token boundaries.

Decoding each token alone breaks multi-byte characters and BPE merges, so we decode a short window
(prefix_offset:) and emit only the text past read_offset once it no longer ends in a partial
UTF-8 character (U+FFFD). Stop strings: `StopStringMatcher` lives in moebus.shared.stop_strings
(one implementation for the engine and the tokenizer service); re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moebus.shared.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from moebus.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]

_WINDOW = 6  # tokens of left context re-decoded so merges at the boundary come out right


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
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
