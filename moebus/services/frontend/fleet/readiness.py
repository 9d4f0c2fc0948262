"""Readiness as the frontend sees it: which served models have a worker that can take a request now.

Workers announce `ready` in their heartbeats only after their engine is built and warmed up (C
kernels compiled, a warm-up forward done: worker/engine_loop.py), so `GET /ready` turning 200
means a first request is served at full speed, not after minutes of compiling. `/health` stays
plain liveness (this process and its bus connection).
"""
from __future__ import annotations

from moebus.shared.messages import KVInfo

from .fleet import FleetView


class WorkerWatch:
    """Ready workers per model, from the workers' heartbeats in the fleet view (fleet.py)."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet

    def ready_workers(self) -> dict[str, list[str]]:
        """model -> its live, ready workers."""
        out: dict[str, list[str]] = {}
        for beat in self.fleet.live("worker"):
            if beat.ready and not beat.draining and beat.model is not None:
                out.setdefault(beat.model, []).append(beat.instance_id)
        return out

    def missing(self, models: list[str]) -> list[str]:
        """The models among `models` no ready worker serves now."""
        ready = self.ready_workers()
        return [m for m in models if not ready.get(m)]

    def kv_space(self, model: str) -> KVInfo | None:
        """How a live worker of `model` names KV blocks (its heartbeat's KVInfo): the space the
        frontend hashes each prompt in, once, for the balancer and the worker."""
        return next((b.kv for b in self.fleet.live("worker") if b.model == model and b.kv is not None), None)
