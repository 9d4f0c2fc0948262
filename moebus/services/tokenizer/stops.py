"""Stop strings over a stream of text deltas, including matches that span token boundaries.

The trick: never release a suffix that could still grow into a stop string; hold it back until
the next delta proves it is not one (or the stream ends).
"""
from __future__ import annotations


def held_suffix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def apply_stops(held: str, delta: str, stops: list[str], *, include_stop: bool = False,
                finished: bool = False) -> tuple[str, str, bool]:
    """Returns (text to release, text to keep holding, stopped)."""
    buf = held + delta
    hits = [(i, -len(s), s) for s in stops if s and (i := buf.find(s)) >= 0]
    if hits:
        idx, _, stop = min(hits)  # earliest match; the longest one when two start together
        return buf[: idx + (len(stop) if include_stop else 0)], "", True
    if finished or not stops:
        return buf, "", False
    keep = held_suffix_len(buf, stops)
    return buf[: len(buf) - keep], buf[len(buf) - keep:], False
