"""The seam between decisions and the fleet: every actuator satisfies `Actuator`.

`scale` is called every tick for every planned pool with the count decided and the workers seen;
it must be idempotent (converge the pool toward `desired`, do nothing once it is there).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from moebus.shared.messages.planner import PoolName

from .fleet import WorkerView


@runtime_checkable
class Actuator(Protocol):
    name: str

    async def scale(self, pool: PoolName, desired: int, workers: Sequence[WorkerView]) -> None: ...

    async def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class NoActuator:
    """Decide and publish only (a dry run, or another controller acts on planner.decision)."""

    name = "none"

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}

    async def scale(self, pool: PoolName, desired: int, workers: Sequence[WorkerView]) -> None:
        self.asked[pool] = desired

    async def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"asked": dict(self.asked)}
