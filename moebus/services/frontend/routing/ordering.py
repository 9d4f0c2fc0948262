"""Chunk order of one attempt: each choice's chunks are passed on in sequence-number order.

A chunk ahead of its turn is held; one already passed on (a duplicate, say from a replay) is
dropped. Chunks that follow on from what was passed on leave together, merged into one chunk per
choice (after a gap is filled, or a replay brings a stream's tail at once, the client gets one
delta instead of dozens, and the frontend detokenizes it in one go). `gap_since`: chunks are held
since then, so some before them are missing.
"""
from __future__ import annotations

import time

from moebus.shared.messages import TokenChunk


class ChunkOrder:
    def __init__(self, n: int) -> None:
        self.next_seq = [0] * n  # per choice, the number of the next chunk to pass on
        self._held: dict[tuple[int, int], TokenChunk] = {}
        self.gap_since: float | None = None
        self.asks = 0  # replays asked for while this gap is open

    def take(self, chunk: TokenChunk) -> None:
        i = chunk.index
        if i < len(self.next_seq) and chunk.seq >= self.next_seq[i]:
            self._held[(i, chunk.seq)] = chunk

    def ready(self) -> list[TokenChunk]:
        """Per choice, the held chunks that follow on from what was passed on (merged)."""
        out: list[TokenChunk] = []
        if not self._held:
            return out
        for i in range(len(self.next_seq)):
            run = []
            while (nxt := self._held.pop((i, self.next_seq[i]), None)) is not None:
                run.append(nxt)
                self.next_seq[i] += 1
            out += merged(run)
        if not self._held:
            self.gap_since, self.asks = None, 0
        elif self.gap_since is None:
            self.gap_since = time.monotonic()
        return out

    def wanted(self, choices: set[int]) -> dict[int, int]:
        """The first chunk number still to come of each of these choices."""
        return {i: self.next_seq[i] for i in sorted(choices) if i < len(self.next_seq)}


def merged(run: list[TokenChunk]) -> list[TokenChunk]:
    """Consecutive chunks of one choice as one (left apart if only some carry text)."""
    if len(run) < 2:
        return run
    texts = [c.text for c in run]
    if None in texts and any(t is not None for t in texts):
        return run
    last = run[-1]
    logprobs = None if all(c.logprobs is None for c in run) else [lp for c in run for lp in c.logprobs or []]
    return [last.model_copy(update={
        "token_ids": [t for c in run for t in c.token_ids], "text": None if None in texts else "".join(texts),
        "logprobs": logprobs, "num_prompt_tokens": last.num_prompt_tokens or run[0].num_prompt_tokens,
        "num_cached_tokens": last.num_cached_tokens or run[0].num_cached_tokens})]
