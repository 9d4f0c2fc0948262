"""Incremental detokenization and stop-string matching across token boundaries.

Decoding each token alone breaks multi-byte characters and BPE merges, so we decode a short window
(prefix_offset:) and emit only the text past read_offset once it no longer ends in a partial
UTF-8 character (U+FFFD). Stop strings are matched on the emitted text plus a held-back tail that
could still become the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moebus.engine.tokenizer import Tokenizer

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


@dataclass
class StopStringMatcher:
    """Feeds text deltas; reports the text safe to emit and whether a stop string was hit."""

    stops: list[str]
    include_stop: bool = False
    pending: str = ""
    stopped: bool = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hit = min(((text.find(s), s) for s in self.stops if s in text), default=None)
        if hit is not None:
            idx, stop = hit
            self.stopped = True
            self.pending = ""
            return text[: idx + len(stop)] if self.include_stop else text[:idx]
        hold = self._partial_suffix(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out

    def _partial_suffix(self, text: str) -> int:
        """Longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-k:]):
                    best = k
                    break
        return best
