"""Replay buffer: the chunks each request's stream already carried, for a frontend that lost some.

In a NATS restart every client reconnects on its own schedule. The worker's nats-py sends what it
buffered while cut off as soon as the worker is back; if the frontend has not re-subscribed yet,
the server drops those chunks (nobody listens). The frontend then sees a gap in a choice's
sequence numbers, or, after its own reconnect, asks for everything after the last chunk it has
(the tail may be lost with nothing after it to show the gap): `worker.replay.<id>` answers both
from here (ReplayRequest -> ReplayReply).

Bounded: per choice at most `max_chunks` (older ones are let go), all requests together at most
`max_bytes` of encoded chunks (finished requests go first, oldest first; then the oldest running
ones), and a finished request's chunks are kept `grace_s` (a frontend reconnects well within it).
An aborted request's go at once (its frontend gave up on it or moved it). Asked for chunks it let
go, or for a request it does not know (the worker restarted), the buffer answers `gone`: the
frontend moves the request to another worker from the tokens it has (migration).

Why not JetStream: it would persist every token chunk on the server with an acknowledgement per
publish, on the hottest path, to cover a few seconds; it cannot take publishes while the server
is down, so the worker would need its own buffer for the outage anyway; and per-request consumers
(or a filtered one per frontend) plus `$JS` API permissions per role are much more machinery than
answering from chunks the worker holds in memory already.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from moebus.shared.messages import TokenChunk
from moebus.shared.messages.generate import ReplayReply, ReplayRequest

MAX_REPLY_BYTES = 1024 * 1024  # one reply carries at most this much (`more`: ask again)


@dataclass(slots=True)
class _Stream:
    attempt: int
    chunks: dict[int, deque[tuple[int, bytes]]] = field(default_factory=dict)  # choice -> (seq, chunk)
    floor: dict[int, int] = field(default_factory=dict)  # choice -> lowest seq still kept, once some were let go
    error: bytes | None = None  # the terminal error chunk
    size: int = 0


class ReplayBuffer:
    def __init__(self, max_bytes: int = 64 * 1024 * 1024, grace_s: float = 30.0, max_chunks: int = 8192) -> None:
        self.max_bytes, self.grace_s, self.max_chunks = max_bytes, grace_s, max_chunks
        self._streams: dict[str, _Stream] = {}  # in the order the requests came
        self._finished: OrderedDict[str, float] = OrderedDict()  # request id -> when it finished
        self.size = 0

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, attempt: int) -> None:
        """A request accepted here: known (maybe with no chunk yet) until it is dropped."""
        self.drop(request_id)
        self._streams[request_id] = _Stream(attempt)

    def record(self, chunk: TokenChunk, data: bytes) -> None:
        """A chunk of the request's stream as sent (`data`: its encoding on the wire)."""
        st = self._streams.get(chunk.request_id)
        if st is None or st.attempt != chunk.attempt or not self.max_bytes:
            return
        if chunk.error:
            st.error = data
        else:
            kept = st.chunks.setdefault(chunk.index, deque())
            kept.append((chunk.seq, data))
            if len(kept) > self.max_chunks:
                self._let_go(st, chunk.index)
        st.size += len(data)
        self.size += len(data)
        self._evict(time.monotonic())

    def finish(self, request_id: str) -> None:
        """The request left this worker: its chunks stay `grace_s` longer."""
        if request_id in self._streams:
            self._finished[request_id] = time.monotonic()
            self._finished.move_to_end(request_id)

    def drop(self, request_id: str) -> None:
        st = self._streams.pop(request_id, None)
        if st is not None:
            self.size -= st.size
            self._finished.pop(request_id, None)

    def replay(self, req: ReplayRequest, max_reply_bytes: int = MAX_REPLY_BYTES) -> ReplayReply:
        self._evict(time.monotonic())
        st = self._streams.get(req.request_id)
        if st is None or st.attempt != req.attempt or not self.max_bytes:
            return ReplayReply(request_id=req.request_id, gone=True)
        out: list[bytes] = []
        size = 0
        for index, first in sorted(req.from_seq.items()):
            if first < st.floor.get(index, 0):
                return ReplayReply(request_id=req.request_id, gone=True)
            for seq, data in st.chunks.get(index, ()):
                if seq < first:
                    continue
                if out and size + len(data) > max_reply_bytes:
                    return ReplayReply(request_id=req.request_id, chunks=_decoded(out), more=True)
                out.append(data)
                size += len(data)
        if st.error is not None:
            out.append(st.error)
        return ReplayReply(request_id=req.request_id, chunks=_decoded(out))

    def _let_go(self, st: _Stream, index: int) -> None:
        kept = st.chunks[index]
        _, data = kept.popleft()
        st.floor[index] = kept[0][0]
        st.size -= len(data)
        self.size -= len(data)

    def _evict(self, now: float) -> None:
        while self._finished:
            rid, done_at = next(iter(self._finished.items()))
            if done_at + self.grace_s > now and self.size <= self.max_bytes:
                break
            self.drop(rid)
        while self.size > self.max_bytes and self._streams:  # only running requests are left
            self.drop(next(iter(self._streams)))


def _decoded(chunks: list[bytes]) -> list[TokenChunk]:
    return [TokenChunk.decode(d) for d in chunks]
