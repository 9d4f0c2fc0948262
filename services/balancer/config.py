from __future__ import annotations

from pydantic import Field

from moebus.shared.service import ServiceConfig


class BalancerConfig(ServiceConfig):
    missed_heartbeats: int = Field(3, ge=1)  # a worker silent this many intervals is dead
    worker_timeout_s: float = 5.0  # how long a worker may take to accept (not to finish) a request
