"""Is a silent instance gone, or only stopped? Asked once its heartbeats are overdue.

Missed heartbeats cannot tell a dead process from a paused one (SIGSTOP, a VM freeze, a long
swap-in): both are silent. The bus can. An instance's health subject answers "no responders" only
once the server dropped its subscriptions, i.e. closed its connection: the process died (its
socket closed with it) or stayed unreachable past the server's own pings. A paused process keeps
its connection and subscriptions, so the request merely times out. Watchers act on "gone" only:
they stop routing to a "paused" one but leave its work where it is.
"""
from __future__ import annotations

from typing import Literal

from .bus import Bus
from .errors import NoResponders
from .messages import HealthReply
from .service import Empty
from .subjects import Subjects

Verdict = Literal["alive", "paused", "gone"]


async def probe(bus: Bus, subjects: Subjects, service: str, instance_id: str, timeout_s: float) -> Verdict:
    try:
        await bus.request(subjects.health(service, instance_id), Empty(), HealthReply, timeout=timeout_s)
    except NoResponders:
        return "gone"
    except Exception:  # a timeout (paused, starved) or an error reply: it is there
        return "paused"
    return "alive"
