"""Is a silent instance gone, or only stopped, or on the far side of a partition? Asked once its
heartbeats are overdue.

Missed heartbeats cannot tell a dead process from a paused one (SIGSTOP, a VM freeze, a long
swap-in): both are silent. The bus can. An instance's health subject answers "no responders" only
once the server dropped its subscriptions, i.e. closed its connection: the process died (its
socket closed with it) or stayed unreachable past the server's own pings. A paused process keeps
its connection and subscriptions, so the request merely times out. Watchers act on "gone" only:
they stop routing to a "paused" one but leave its work where it is.

Across hosts the same "no responders" also follows a split: once the route between two NATS
nodes fails, each forgets the other's subscriptions. So when the instance's node (its heartbeat's
`bus_node`) is no longer routed to ours (shared/cluster_view.py), it is "unreachable": treated
like "paused" (its work waits for the heal, nobody replaces it) until it has been silent for
`grace_s`, after which a host that is really gone is given up on ("gone").
"""
from __future__ import annotations

import math
import time
from typing import Literal

from .bus import Bus
from .cluster_view import ClusterView
from .errors import NoResponders
from .messages import HealthReply
from .service import Empty
from .subjects import Subjects

Verdict = Literal["alive", "paused", "unreachable", "gone"]


async def probe(bus: Bus, subjects: Subjects, service: str, instance_id: str, timeout_s: float, *,
                node: str | None = None, view: ClusterView | None = None, silent_since: float = -math.inf,
                grace_s: float = math.inf) -> Verdict:
    """node: the bus node the instance's last heartbeat named; view: ours (None: no partition is
    ever seen); silent_since: monotonic time of its last sign of life."""
    try:
        await bus.request(subjects.health(service, instance_id), Empty(), HealthReply, timeout=timeout_s)
    except NoResponders:
        now = time.monotonic()
        if view is not None and await view.cut_off(bus, node, now) and now - silent_since <= grace_s:
            return "unreachable"
        return "gone"
    except Exception:  # a timeout (paused, starved) or an error reply: it is there
        return "paused"
    return "alive"
