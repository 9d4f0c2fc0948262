"""Suspects run alone: a request whose earlier attempt was on an engine that broke (or a worker
that died) may be the cause, or only its neighbour. Run by itself, a poison breaks this engine
with nobody else in it, and an innocent neighbour is no longer caught with it a second time (the
frontend stops retrying a request after it broke `max_worker_failures` workers).

A suspect waits until the engine holds none of this worker's requests; while it runs, later
requests wait behind it, in arrival order. Costs nothing when there are no suspects.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class Quarantine:
    def __init__(self, add: Callable[[Any], None]) -> None:
        self._add = add  # puts a request (a worker's Active) into the engine
        self._held: deque[Any] = deque()
        self._in_engine: set[str] = set()
        self._suspect: str | None = None  # the suspect in the engine now

    @property
    def held(self) -> int:
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here (it has not reached the engine)."""
        return any(a.req.request_id == request_id for a in self._held)

    def submit(self, active: Any) -> None:
        self._held.append(active)
        self._release()

    def done(self, request_id: str) -> None:
        """The request left the worker (finished, failed, aborted), admitted or not."""
        self._in_engine.discard(request_id)
        self._held = deque(a for a in self._held if a.req.request_id != request_id)
        if request_id == self._suspect:
            self._suspect = None
        self._release()

    def _release(self) -> None:
        while self._held and self._suspect is None:
            active = self._held[0]
            rid = active.req.request_id
            if active.req.suspect:
                if self._in_engine:
                    return  # alone means alone: wait for the engine to empty
                self._suspect = rid
            self._held.popleft()
            self._in_engine.add(rid)
            self._add(active)
