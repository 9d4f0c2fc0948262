"""What `moebus up` does when one of its processes exits: restart it, with backoff, under the
same instance id and command line; give up (and stop the stack, loudly) when one crashes too often.
nats-server nodes too (same port, users and routes): meanwhile every client rides out the outage
as it does a NATS restart (RELIABILITY.md), and in a cluster moves to another node.

A worker that exits 0 was drained on purpose (the planner's scale-in, or an operator's `drain`
message) and stays down; anything else that exits is restarted. Its clients ride out the gap:
the frontend waits `restart_wait_s` for a tokenizer or balancer to answer again, and a worker's
requests migrate (the new process's heartbeat carries a new incarnation).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


class Process(Protocol):
    def poll(self) -> int | None: ...


class Supervised(Protocol):
    """What the supervisor needs of the stack (launcher.Stack satisfies it)."""

    @property
    def procs(self) -> Mapping[str, Process]: ...

    @property
    def services(self) -> Mapping[str, str]: ...

    @property
    def nats_procs(self) -> Mapping[str, Process]: ...  # the nats-server nodes it started, by name

    def respawn(self, instance_id: str) -> None: ...

    def forget(self, instance_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts of one process within window_s before giving up
    window_s: float = 300.0
    backoff_s: float = 1.0  # the n-th restart in the window waits n x this
    max_backoff_s: float = 30.0


@dataclass(slots=True)
class Supervisor:
    stack: Supervised
    policy: RestartPolicy = RestartPolicy()
    clock: Callable[[], float] = time.monotonic
    restarts: dict[str, deque[float]] = field(default_factory=dict)  # instance -> recent restart times
    due: dict[str, float] = field(default_factory=dict)  # instance -> when to restart it

    def check(self) -> str | None:
        """One pass over the processes; a reason to give up, or None."""
        now = self.clock()
        for instance, proc in [*self.stack.nats_procs.items(), *self.stack.procs.items()]:
            code = proc.poll()
            if code is None:
                continue
            if code == 0 and self.stack.services.get(instance) == "worker":
                log.info("%s drained and exited", instance)
                self.stack.forget(instance)
                continue
            if instance not in self.due:
                recent = self.restarts.setdefault(instance, deque())
                while recent and recent[0] < now - self.policy.window_s:
                    recent.popleft()
                if len(recent) >= self.policy.max_restarts:
                    return (f"{instance} exited with {code} after {len(recent)} restarts in "
                            f"{self.policy.window_s:g} s; giving up")
                wait = min(self.policy.backoff_s * (len(recent) + 1), self.policy.max_backoff_s)
                log.error("%s exited with %s; restarting it in %.1f s", instance, code, wait)
                self.due[instance] = now + wait
            elif now >= self.due[instance]:
                del self.due[instance]
                self.restarts[instance].append(now)
                self.stack.respawn(instance)
        return None
