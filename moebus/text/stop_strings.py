"""Stop strings over a stream of text deltas: the one implementation (engine and tokenizer service).

Semantics (OpenAI / vLLM): generation ends where the first stop string is complete. The output is
the text before that stop string (the stop string itself too with `include_stop`). "First" is the
stop string that ends earliest in the text; of those ending at the same place, the one starting
earliest (the longest). That is the order in which they appear when text arrives one character at
a time, so the result never depends on how the text was cut into deltas (token boundaries).

Across deltas: a suffix that could still grow into a stop string is never released; it is held
back until the next delta proves it is not one (or the stream ends). Empty stop strings are ignored.

Pure Python, no internal imports: the engine (llm_engine, request_table) and the tokenizer service
both use it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the first complete stop string in `text` (earliest end, then earliest start)."""
    hits = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return None
    end, start = min(hits)
    return start, end


def matched_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop string `apply_stops` stops at in `text` (its response's stop_reason), or None."""
    hit = find_stop(text, stops)
    return None if hit is None else text[hit[0]:hit[1]]


def apply_stops(held: str, delta: str, stops: Sequence[str], *, include_stop: bool = False,
                finished: bool = False) -> tuple[str, str, bool]:
    """One step, stateless: returns (text to release, text to keep holding, stopped).

    `held` is what the previous step kept back; `finished`: no more text follows (release it all).
    """
    buf = held + delta
    hit = find_stop(buf, stops)
    if hit is not None:
        start, end = hit
        return buf[: end if include_stop else start], "", True
    if finished or not stops:
        return buf, "", False
    keep = held_suffix_len(buf, stops)
    return buf[: len(buf) - keep], buf[len(buf) - keep:], False


@dataclass
class StopStringMatcher:
    """The stateful form of `apply_stops`: feed text deltas, get the text safe to emit."""

    stops: list[str] = field(default_factory=list)
    include_stop: bool = False
    pending: str = ""  # held back: might be the start of a stop string
    stopped: bool = False
    matched: str | None = None  # the stop string that ended it


    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + delta
        text, self.pending, self.stopped = apply_stops(self.pending, delta, self.stops,
                                                       include_stop=self.include_stop)
        if self.stopped:
            self.matched = matched_stop(buf, self.stops)
        return text

    def flush(self) -> str:
        """End of stream: the held-back text (nothing once a stop string matched)."""
        out, self.pending = self.pending, ""
        return "" if self.stopped else out
