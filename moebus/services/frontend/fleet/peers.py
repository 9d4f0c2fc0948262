"""How many frontends share the tenants' limits, counted from their heartbeats.

A tenant's rate and token budget are the whole deployment's, not each frontend's: with N
frontends alive, each enforces 1/N of them (admission.py), so a tenant whose requests are spread
over the frontends gets its limit in total, not N times it. No shared counter and no extra hop per
request; the price: a tenant whose traffic reaches only some of the frontends gets only their
shares. N is this frontend plus every other one heard within MISSED_BEATS of its interval,
draining ones included (they still hold their requests). A frontend that starts counts only itself
until it hears the others' beats (within one heartbeat interval); the others count it from its
first beat, which it sends as it starts. One that dies leaves its share unused until its beats are
missed (MISSED_BEATS intervals).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.msg import Msg

from moebus.shared.bus import Bus
from moebus.shared.messages import Heartbeat
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects

from .fleet import MISSED_BEATS


class FrontendPeers:
    def __init__(self, instance_id: str, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.instance_id, self._clock = instance_id, clock
        self._seen: dict[str, tuple[float, float]] = {}  # other frontend -> (its last beat, its interval)
        self._m_count = metrics.gauge("frontends_alive", "Frontends sharing each tenant's limits (this one included)")
        self._m_count.set(1)

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        await bus.subscribe(subjects.heartbeat_all("frontend"), Heartbeat, self._on_beat, concurrent=False,
                            traced=False, endpoint="frontend_heartbeat")

    async def _on_beat(self, beat: Heartbeat, _: Msg) -> None:
        self.observe(beat)

    def observe(self, beat: Heartbeat) -> None:
        """A frontend's beat (its own too: the gauge then stays current while nobody asks)."""
        if beat.instance_id != self.instance_id:
            self._seen[beat.instance_id] = (self._clock(), beat.interval_s)
        self.count()

    def count(self) -> int:
        """This frontend and the others alive now (>= 1)."""
        now = self._clock()
        for peer, (at, interval) in list(self._seen.items()):
            if now - at > MISSED_BEATS * interval:
                del self._seen[peer]
        n = 1 + len(self._seen)
        self._m_count.set(n)
        return n
