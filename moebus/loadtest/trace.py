"""The request list a load test replays, and its shaping: a time window, a time scale (speed-up),
a length scale and caps. Every reader (formats.py, synthetic.py) yields TraceRequests."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

BLOCK_TOKENS = 512  # Mooncake: each hash id stands for one block of this many prompt tokens


class TraceError(ValueError):
    """A trace file (or one of its rows) that cannot be read; the message names the file and line."""


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float  # relative to the trace's first request
    input_tokens: int  # prompt length (ignored when text or messages are given)
    output_tokens: int  # forced output length
    hash_ids: list[int] = field(default_factory=list)  # shared ids = shared prefix blocks
    text: str | None = None  # a literal prompt (aiperf text_input)
    messages: list[dict] | None = None  # a literal chat (aiperf messages)
    line: int = 0  # source line, for messages


@dataclass(slots=True)
class Shaping:
    """How a trace sized for a GPU fleet is fitted to the machine under test (the report states it)."""

    start_s: float = 0.0  # window start, in trace time
    duration_s: float | None = None  # window length, in trace time (None: to the end)
    time_scale: float = 1.0  # speed-up: 2.0 replays the trace twice as fast
    length_scale: float = 1.0  # input and output lengths (and the prefix block size) are multiplied by this
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_requests: int | None = None
    output_scale: float | None = None  # output lengths only (None: length_scale)

    def __post_init__(self) -> None:
        if min(self.time_scale, self.length_scale, 1.0 if self.output_scale is None else self.output_scale) <= 0:
            raise ValueError("time_scale, length_scale and output_scale must be > 0")
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise ValueError("start must be >= 0 and duration > 0")

    @property
    def block_tokens(self) -> int:
        return max(1, round(BLOCK_TOKENS * self.length_scale))

    def apply(self, reqs: list[TraceRequest]) -> list[TraceRequest]:
        """The window, re-based to 0 and sped up; lengths scaled (>= 1) and capped."""
        reqs = sorted(reqs, key=lambda r: r.arrival_s)
        end = None if self.duration_s is None else self.start_s + self.duration_s
        win = [r for r in reqs if r.arrival_s >= self.start_s and (end is None or r.arrival_s < end)]
        if self.max_requests is not None:
            win = win[: self.max_requests]
        out = []
        for r in win:
            literal = r.text is not None or r.messages is not None  # its length is what it is
            n_in = r.input_tokens if literal else _cap(self._scaled_input(r), self.max_input_tokens)
            out_scale = self.length_scale if self.output_scale is None else self.output_scale
            n_out = _cap(max(1, round(r.output_tokens * out_scale)), self.max_output_tokens)
            out.append(replace(r, arrival_s=(r.arrival_s - self.start_s) / self.time_scale,
                               input_tokens=n_in, output_tokens=n_out))
        if out:  # the window's first request starts the clock
            t0 = out[0].arrival_s
            for r in out:
                r.arrival_s -= t0
        return out

    def _scaled_input(self, r: TraceRequest) -> int:
        """The prompt length times length_scale, block by block where the request has hash ids.

        Each id names one BLOCK_TOKENS block of the prompt (the last may be partial). Scaling the
        length and the block size apart loses ids: round(1025 x 0.05) = 51 tokens hold only two
        blocks of round(512 x 0.05) = 26, so the third id (and the sharing it stands for) is gone.
        So whole blocks stay whole scaled blocks, the last partial block keeps at least one token
        (at most a block), and tokens past the ids scale on their own: every id keeps its block, and
        the length is off the plain product by under half a token per block."""
        n, ids = r.input_tokens, len(r.hash_ids)
        if not ids:
            return max(1, round(n * self.length_scale))
        block = self.block_tokens
        covered = min(n, ids * BLOCK_TOKENS)
        full, tail = divmod(covered, BLOCK_TOKENS)
        last = min(block, max(1, round(tail * self.length_scale))) if tail else 0
        return max(1, full * block + last + round((n - covered) * self.length_scale))

    def describe(self) -> dict:
        return {"start_s": self.start_s, "duration_s": self.duration_s, "time_scale": self.time_scale,
                "length_scale": self.length_scale, "output_scale": self.output_scale, "block_tokens": self.block_tokens,
                "max_input_tokens": self.max_input_tokens, "max_output_tokens": self.max_output_tokens,
                "max_requests": self.max_requests}


def _cap(n: int, cap: int | None) -> int:
    return n if cap is None else max(1, min(n, cap))
