"""Frontend leases: a request whose frontend died is aborted here, and its KV freed.

A frontend's heartbeat is its lease on the requests it sent (GenerateRequest.frontend_id and
frontend_incarnation). The lease is lost when
- a beat of that frontend names another incarnation (it was restarted: the old process's
  streams have no reader), or
- nothing was heard of it for `lease_s` while we could hear (Bus.evidence_since: a worker that was
  cut off itself judges nobody for its own outage, nor for `settle_s` after it), and its health
  subject has no responders: the server closed its connection (shared/liveness.py). A frontend
  that is only paused (or a machine that froze with all of us) keeps its lease, and so does one
  whose bus node ours no longer routes to (a partition: its streams are replayed after the heal),
  until it has been silent `grace_s`.
The first request from a frontend not heard yet counts as hearing from it. Draining frontends keep
their lease (they finish their streams). `run()` aborts what lost its lease (the worker's abort:
engine request gone, KV blocks freed, replay dropped).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from moebus.shared.bus import Bus
from moebus.shared.cluster_view import ClusterView
from moebus.shared.liveness import probe
from moebus.shared.messages import GenerateRequest, Heartbeat
from moebus.shared.subjects import Subjects

log = logging.getLogger(__name__)

Owner = tuple[str, str]  # (frontend instance id, its incarnation)


@dataclass(slots=True)
class _Lease:
    incarnation: str
    last_seen: float
    node: str | None = None  # the bus node of its latest beat


class FrontendLeases:
    def __init__(self, lease_s: float, view: ClusterView | None = None, grace_s: float = math.inf) -> None:
        self.lease_s = lease_s  # 0: leases off (nothing is ever lost)
        self.view = view
        self.grace_s = grace_s
        self._frontends: dict[str, _Lease] = {}

    def observe(self, beat: Heartbeat, now: float) -> None:
        lease = self._frontends.get(beat.instance_id)
        if lease is None or lease.incarnation != beat.incarnation:
            self._frontends[beat.instance_id] = _Lease(beat.incarnation, now, beat.bus_node)
        else:
            lease.last_seen, lease.node = now, beat.bus_node

    def hold(self, owner: Owner, now: float) -> None:
        """A request from `owner` arrived: that process was alive just now (if it names another
        incarnation than the beats, it is the newer one: its beat is still on its way)."""
        frontend, incarnation = owner
        lease = self._frontends.get(frontend)
        if lease is None or lease.incarnation != incarnation:
            self._frontends[frontend] = _Lease(incarnation, now)
        else:
            lease.last_seen = max(lease.last_seen, now)

    def lost(self, owners: Iterable[Owner], now: float, since: float = -math.inf) -> set[Owner]:
        """The owners among `owners` whose lease is gone. since: silence before this does not count."""
        if self.lease_s <= 0:
            return set()
        out = set()
        for owner in set(owners):
            frontend, incarnation = owner
            lease = self._frontends.get(frontend)
            if lease is None:
                continue  # hold() was never called for it: not ours to judge
            if lease.incarnation != incarnation or now - max(lease.last_seen, since) > self.lease_s:
                out.add(owner)
        return out

    def renew(self, frontend: str, now: float) -> None:
        """It answered (or is merely paused): silence is no reason to drop its requests."""
        if (lease := self._frontends.get(frontend)) is not None:
            lease.last_seen = now

    async def _gone(self, bus: Bus, subjects: Subjects, lost: set[Owner], timeout_s: float) -> set[Owner]:
        """Of the owners whose lease lapsed, those really gone: restarted, or no longer on the bus."""
        silent = {f: lease for f, inc in lost if (lease := self._frontends.get(f)) and lease.incarnation == inc}
        verdicts = dict(zip(silent, await asyncio.gather(*(
            probe(bus, subjects, "frontend", f, timeout_s, node=lease.node, view=self.view,
                  silent_since=lease.last_seen, grace_s=self.grace_s) for f, lease in silent.items())), strict=True))
        now = time.monotonic()
        for f, v in verdicts.items():
            if v in ("alive", "paused"):  # (unreachable: its silence goes on counting toward grace_s)
                self.renew(f, now)
        return {o for o in lost if verdicts.get(o[0], "gone") == "gone"}

    async def run(self, bus: Bus, subjects: Subjects, requests: Callable[[], Iterable[GenerateRequest]],
                  abort: Callable[[str], Awaitable[None]], interval_s: float) -> None:
        """Every interval_s: abort the requests whose frontend lost its lease. Only after a round
        trip to the server shows our own traffic flows (beats queued behind it are counted first)."""
        while True:
            await asyncio.sleep(interval_s)
            owned = [r for r in requests() if r.frontend_id]
            if not owned or not self.lost(((r.frontend_id, r.frontend_incarnation) for r in owned),
                                          time.monotonic(), bus.evidence_since):
                continue
            try:
                await bus.flush(timeout=max(interval_s, 0.5))
            except Exception:  # cut off, or the server is going away: judge nobody now
                continue
            gone = self.lost(((r.frontend_id, r.frontend_incarnation) for r in owned), time.monotonic(),
                             bus.evidence_since)
            gone = await self._gone(bus, subjects, gone, max(interval_s, 0.5)) if gone else gone
            for r in owned:
                if (r.frontend_id, r.frontend_incarnation) in gone:
                    log.warning("frontend %s (%s) is gone: aborting its request %s", r.frontend_id,
                                r.frontend_incarnation or "?", r.request_id)
                    await abort(r.request_id)
