"""Readiness as the frontend sees it: which served models have a worker that can take a request now.

Workers announce `ready` in their heartbeats only after their engine is built and warmed up (C
kernels compiled, a warm-up forward done: worker/engine_loop.py), so `GET /ready` turning 200
means a first request is served at full speed, not after minutes of compiling. `/health` stays
plain liveness (this process and its bus connection).
"""
from __future__ import annotations

import time

from nats.aio.msg import Msg

from moebus.shared.bus import Bus
from moebus.shared.messages import Heartbeat
from moebus.shared.subjects import Subjects

MISSED_BEATS = 3  # a worker silent this many intervals no longer counts


class WorkerWatch:
    """Ready workers per model, from their heartbeats."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects
        self._seen: dict[str, tuple[str, float, float]] = {}  # instance -> (model, last beat, interval)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.heartbeat_all("worker"), Heartbeat, self._on_beat,
                                 concurrent=False, traced=False, endpoint="worker_heartbeat")

    async def _on_beat(self, beat: Heartbeat, _: Msg) -> None:
        if beat.draining or not beat.ready or beat.model is None:
            self._seen.pop(beat.instance_id, None)
        else:
            self._seen[beat.instance_id] = (beat.model, time.monotonic(), beat.interval_s)

    def ready_workers(self) -> dict[str, list[str]]:
        """model -> its live, ready workers."""
        now, out = time.monotonic(), {}
        for instance, (model, ts, interval) in self._seen.items():
            if now - ts <= MISSED_BEATS * interval:
                out.setdefault(model, []).append(instance)
        return out

    def missing(self, models: list[str]) -> list[str]:
        """The models among `models` no ready worker serves now."""
        ready = self.ready_workers()
        return [m for m in models if not ready.get(m)]
