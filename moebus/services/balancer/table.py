"""The balancer's view of the workers, fed by heartbeats: liveness and least-loaded ordering.

Heartbeats are up to one interval stale, so every assignment also counts as `pending` load until
the worker's next heartbeat reports it; that spreads a burst instead of piling it onto whichever
worker looked idlest a moment ago. `pending_tokens` says how much: the prefill tokens each pending
request was estimated to cost there (a follow-up with a cached prefix costs a few, a new prompt
all of its tokens), so a finished follow-up the worker has not reported yet does not push the next
one off its cache.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from moebus.shared.messages import Heartbeat


@dataclass(slots=True)
class WorkerEntry:
    beat: Heartbeat
    last_seen: float
    pending: int = 0  # assigned since the last heartbeat
    pending_tokens: float = 0.0  # their estimated prefill tokens on this worker
    assigned_total: int = 0  # tiebreak: among equals, the one picked least often (round robin)
    skip_until: float = 0.0  # not routable for a while (it just answered no-responders)

    @property
    def worker_id(self) -> str:
        return self.beat.instance_id

    @property
    def queued(self) -> int:
        return (self.beat.load.num_waiting if self.beat.load else 0) + self.pending

    @property
    def full(self) -> bool:
        load = self.beat.load
        return load is not None and load.max_waiting > 0 and self.queued >= load.max_waiting

    def sort_key(self) -> tuple:
        load = self.beat.load
        running = load.num_running if load else 0
        free = load.kv_blocks_free if load else 0
        return (self.full, self.queued, running, -free, self.assigned_total, self.worker_id)


class WorkerTable:
    def __init__(self, missed_heartbeats: int = 3) -> None:
        self.missed = missed_heartbeats
        self._workers: dict[str, WorkerEntry] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def observe(self, beat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when it comes from a new process under a known id (a restart:
        what the old one held is lost)."""
        entry = self._workers.get(beat.instance_id)
        if entry is None:
            self._workers[beat.instance_id] = WorkerEntry(beat, now)
            return False
        restarted = entry.beat.incarnation != beat.incarnation
        if restarted:
            self._workers[beat.instance_id] = WorkerEntry(beat, now)
        else:
            entry.beat, entry.last_seen, entry.pending, entry.pending_tokens = beat, now, 0, 0.0
        return restarted

    def silent(self, now: float, since: float = -math.inf,
               deaf: Callable[[float], float] = lambda _: 0.0) -> list[str]:
        """Workers that missed too many heartbeats. since: silence before this does not count (we
        could not hear them: Bus.evidence_since; +inf: nobody is silent); deaf(t): seconds after
        t that we could not listen either (our own loop stalled: LoopStalls.since)."""
        out = []
        for w, e in self._workers.items():
            start = max(e.last_seen, since)
            if now - start - deaf(start) > self.missed * e.beat.interval_s:
                out.append(w)
        return out

    def expire(self, now: float, since: float = -math.inf,
               deaf: Callable[[float], float] = lambda _: 0.0) -> list[str]:
        """Drop the silent workers; returns their ids."""
        dead = self.silent(now, since, deaf)
        for w in dead:
            del self._workers[w]
        return dead

    def heard(self, worker_id: str, now: float) -> None:
        """It answered a probe: alive, whatever its late beats said."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.last_seen = now

    def remove(self, worker_id: str) -> bool:
        return self._workers.pop(worker_id, None) is not None

    def skip(self, worker_id: str, now: float) -> bool:
        """No new work for it a while; True when it was taking work until now."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        first = entry.skip_until < entry.last_seen
        entry.skip_until = now + 1.5 * entry.beat.interval_s
        return first

    def candidates(self, model: str, now: float, exclude: set[str] = frozenset(),
                   roles: tuple[str, ...] | None = None) -> list[WorkerEntry]:
        """Routable workers for `model` (of `roles`, None: any), best first (full ones last:
        their numbers may be stale)."""
        ok = [e for e in self._workers.values()
              if e.beat.model == model and e.beat.ready and not e.beat.draining
              and e.worker_id not in exclude and e.skip_until <= now
              and (roles is None or (e.beat.role or "both") in roles)]
        return sorted(ok, key=WorkerEntry.sort_key)

    def assigned(self, worker_id: str, n: int = 1, tokens: float = 0.0) -> None:
        """Count a pick right away (before the worker answers) so concurrent routes spread out;
        n=-1 takes it back when the worker refused. tokens: its estimated prefill tokens there."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.pending = max(0, entry.pending + n)
            entry.pending_tokens = max(0.0, entry.pending_tokens + n * tokens) if entry.pending else 0.0
            entry.assigned_total += max(n, 0)

    def snapshot(self, now: float) -> list[dict]:
        """Each worker as routing sees it; heard_s_ago: since its last beat (or answered probe), skipped:
        it gets no new work now (it answered a probe as paused or unreachable)."""
        return [{"worker_id": e.worker_id, "model": e.beat.model, "ready": e.beat.ready, "role": e.beat.role,
                 "draining": e.beat.draining, "heard_s_ago": round(now - e.last_seen, 3),
                 "skipped": e.skip_until > now, "queued": e.queued, "pending": e.pending,
                 "pending_tokens": e.pending_tokens,
                 "load": e.beat.load.model_dump() if e.beat.load else None} for e in self._workers.values()]
