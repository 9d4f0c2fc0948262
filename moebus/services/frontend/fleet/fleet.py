"""The fleet as this frontend hears it: every service instance's heartbeats (one subscription for
all of them), kept with their load and turned into rows of `moebus status` and the
`moebus_frontend_fleet_*` gauges on the API's /metrics (shared/fleet_status.py).

An instance silent for MISSED_BEATS intervals is `missing` (SIGKILLed, hung, cut off) until it
beats again (the supervisor's restart: same id, `restarts` one more) or `forget_after_s` passes;
one whose last beat said draining left on purpose and is dropped once silent. A missing instance
heard again (same process: a partition healed, a pause ended) is told to `on_return`. Pure but for
`start()`: beats and the time come in, so it is tested without a bus.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nats.aio.msg import Msg
from prometheus_client.core import Metric

from moebus.shared.bus import Bus
from moebus.shared.bus_auth import ANY
from moebus.shared.fleet_status import InstanceStatus, State, to_families
from moebus.shared.load_rates import LoadRates
from moebus.shared.messages import Heartbeat, Load
from moebus.shared.metrics import Metrics
from moebus.shared.subjects import Subjects

MISSED_BEATS = 3  # an instance silent this many intervals is missing (and no worker to route to)
FORGET_AFTER_S = 600.0  # a missing instance is listed this long, then dropped (scaled in, renamed)
RATE_WINDOW_S = 10.0  # tokens/s over the beats of this window


@dataclass(slots=True)
class _Seen:
    beat: Heartbeat
    at: float  # monotonic time of its last beat
    rates: LoadRates


class FleetView:
    def __init__(self, clock: Callable[[], float] = time.monotonic, forget_after_s: float = FORGET_AFTER_S,
                 on_return: Callable[[Heartbeat], None] = lambda _: None) -> None:
        self.clock, self.forget_after_s, self.on_return = clock, forget_after_s, on_return
        self._seen: dict[str, _Seen] = {}  # instance id -> what we last heard

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        await bus.subscribe(subjects.heartbeat(ANY, ANY), Heartbeat, self._on_beat, concurrent=False,
                            traced=False, endpoint="heartbeat")

    def export(self, metrics: Metrics) -> None:
        """The fleet gauges on this registry, computed at each scrape."""
        metrics.registry.register(_Collector(self))

    async def _on_beat(self, beat: Heartbeat, _: Msg) -> None:
        self.observe(beat)

    def observe(self, beat: Heartbeat) -> None:
        seen, now = self._seen.get(beat.instance_id), self.clock()
        back = seen is not None and self._silent(seen, now) and seen.beat.incarnation == beat.incarnation
        if seen is None or seen.beat.service != beat.service:
            seen = self._seen[beat.instance_id] = _Seen(beat, 0.0, LoadRates(RATE_WINDOW_S))
        seen.beat, seen.at = beat, now
        if beat.load is not None:
            seen.rates.add(beat.ts, beat.load)
        if back:
            self.on_return(beat)

    def live(self, service: str) -> Iterator[Heartbeat]:
        """The last beats of the instances of `service` that are not missing."""
        now = self.clock()
        for s in self._seen.values():
            if s.beat.service == service and not self._silent(s, now):
                yield s.beat

    def rows(self) -> list[InstanceStatus]:
        now = self.clock()
        self._expire(now)
        return sorted((self._row(s, now) for s in self._seen.values()), key=lambda r: (r.service, r.instance_id))

    def _silent(self, s: _Seen, now: float) -> bool:
        return now - s.at > MISSED_BEATS * max(s.beat.interval_s, 1e-3)

    def _expire(self, now: float) -> None:
        for i, s in list(self._seen.items()):
            if self._silent(s, now) and (s.beat.draining or now - s.at > self.forget_after_s):
                del self._seen[i]

    def _row(self, s: _Seen, now: float) -> InstanceStatus:
        b = s.beat
        state: State = ("missing" if self._silent(s, now) else "draining" if b.draining
                        else "ready" if b.ready else "starting")
        row = InstanceStatus(instance_id=b.instance_id, service=b.service, state=state, restarts=b.restarts,
                             heartbeat_age_s=round(now - s.at, 3))
        if b.load is None or state == "missing":  # a missing worker's last load is not its load now
            return row
        return row.model_copy(update=_load_fields(b.load, s.rates))


def _load_fields(load: Load, rates: LoadRates) -> dict[str, float | int | None]:
    return {"running": load.num_running, "waiting": load.num_waiting, "kv_usage": load.kv_usage(),
            "prefix_cache_hit_rate": load.prefix_cache_hit_rate(), "output_tokens_per_s": rates.rates().output_tokens,
            "ttft_p50_s": load.ttft_p50_s, "ttft_p90_s": load.ttft_p90_s,
            "itl_p50_s": load.itl_p50_s, "itl_p90_s": load.itl_p90_s}


class _Collector:
    """prometheus_client's custom collector protocol: collect() at each scrape."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet

    def collect(self) -> list[Metric]:
        return to_families(self.fleet.rows())
