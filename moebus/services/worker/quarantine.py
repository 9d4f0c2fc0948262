"""Suspects run together, apart from everyone else, and are split when they break the engine again.

A request whose earlier attempt was on an engine that broke (or a worker that died) may be the
cause, or only its neighbour. The suspects of this worker run as one batch, with none of its other
requests beside them: a poison among them breaks this engine with only suspects in it, and the
innocent ones were not held up one by one behind each other (11 streams of a killed worker all
resume at once, not 2 s apart). When a batch of two or more breaks the engine, the worker keeps
them (resumed from the tokens they streamed) and runs the two halves one after the other
(`bisect`); a suspect that breaks the engine alone is failed to its frontend, which then stops
retrying it (`max_worker_failures`): a poison still breaks no more workers than before, and an
innocent neighbour is never convicted with it.

`isolate` suspects (their batch died with its worker: the frontend cannot tell who killed it) run
alone. While a batch runs, later requests wait in arrival order; suspects arriving meanwhile join
the batch unless it is a half of a split one or an isolated suspect. Costs nothing without suspects.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any


class Quarantine:
    def __init__(self, add: Callable[[Any], None]) -> None:
        self._add = add  # puts a request (a worker's Active) into the engine
        self._held: deque[Any] = deque()
        self._in_engine: set[str] = set()
        self._batch: set[str] = set()  # the suspects in the engine now; others wait while it is not empty
        self._joinable = False  # fresh suspects may join the running batch (not a split half, not an isolated one)
        self._halves: deque[list[Any]] = deque()  # split batches waiting to run, each as one batch

    @property
    def held(self) -> int:
        return len(self._held) + sum(map(len, self._halves))

    @property
    def batch(self) -> frozenset[str]:
        """The suspects in the engine now."""
        return frozenset(self._batch)

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here (it has not reached the engine)."""
        return any(a.req.request_id == request_id for a in self._waiting())

    def submit(self, active: Any) -> None:
        self._held.append(active)
        self._release()

    def done(self, request_id: str) -> None:
        """The request left the worker (finished, failed, aborted), admitted or not."""
        self._in_engine.discard(request_id)
        self._batch.discard(request_id)
        self._held = deque(a for a in self._held if a.req.request_id != request_id)
        self._halves = deque(h for h in ([a for a in half if a.req.request_id != request_id] for half in self._halves)
                             if h)
        self._release()

    def bisect(self, actives: Sequence[Any]) -> None:
        """The engine broke with this batch (two or more, already set to resume where they were) in
        it: run its two halves again, one after the other, before anything else."""
        ids = {a.req.request_id for a in actives}
        self._in_engine -= ids
        self._batch -= ids
        ordered = sorted(actives, key=lambda a: a.req.request_id)
        mid = len(ordered) // 2
        self._halves.extendleft([ordered[mid:], ordered[:mid]])  # (extendleft reverses: first half first)
        self._release()

    def _waiting(self) -> list[Any]:
        return [*self._held, *(a for half in self._halves for a in half)]

    def _admit(self, active: Any, suspect: bool) -> None:
        rid = active.req.request_id
        self._in_engine.add(rid)
        if suspect:
            self._batch.add(rid)
        self._add(active)

    def _release(self) -> None:
        if self._batch:  # a batch runs: fresh suspects may join it, nobody else enters
            if self._joinable:
                self._admit_joiners()
            return
        if self._halves:  # a split batch's next half, once the engine is empty
            if not self._in_engine:
                self._joinable = False
                for a in self._halves.popleft():
                    self._admit(a, True)
            return
        while self._held:
            head = self._held[0]
            if not head.req.suspect:
                self._admit(self._held.popleft(), False)
                continue
            if self._in_engine:
                return  # a batch starts on an empty engine
            if head.req.isolate:
                self._joinable = False
                self._admit(self._held.popleft(), True)
                return
            self._joinable = True
            self._admit_joiners()
            return

    def _admit_joiners(self) -> None:
        """Every held suspect that may run in a batch, out of the queue and into the engine."""
        for a in [a for a in self._held if a.req.suspect and not a.req.isolate]:
            self._held.remove(a)
            self._admit(a, True)
