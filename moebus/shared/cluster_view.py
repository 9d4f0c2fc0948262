"""Which hosts our own NATS node has routes to now: a partition seen from inside.

A silent instance whose health subject has no responders is gone (its connection closed), unless
the node it was connected to (its heartbeat's `bus_node`) is on a host our node no longer has a
route to: then the cluster is split, or that host is down, and the instance may well be alive on
the other side (shared/liveness.py: "unreachable"). The route table is the server's own: its
monitoring endpoint's /routez (each route's peer address; /varz says which node answers). A route
younger than ROUTE_SETTLE_S does not count yet: right after a heal the route is up before the
peer's subscriptions have crossed it, and a "no responders" then is the partition's, not a death.
The table is read only while we are connected to that very node; otherwise, and on one host
(every node at the same address), nothing is ever cut off and silence is judged as before.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime

from .bus import Bus

log = logging.getLogger(__name__)
ANY_ADDRESS = ("0.0.0.0", "::", "")
ROUTE_SETTLE_S = 2.0  # a new route carries its peer's interest within this long (measured: milliseconds)


@dataclass(frozen=True, slots=True)
class Routes:
    node: tuple[str, int]  # the monitored node's client listener (host, port)
    peers: frozenset[str]  # IP addresses of the nodes it has had a route to for ROUTE_SETTLE_S


class ClusterView:
    def __init__(self, monitor_url: str | None, ttl_s: float = 0.5) -> None:
        self.monitor_url = monitor_url.rstrip("/") if monitor_url else None  # our host's node, e.g. http://127.0.0.1:8222
        self.ttl_s = ttl_s
        self._cached: tuple[float, Routes] | None = None
        self._ips: dict[str, str] = {}  # host name -> IP address

    async def routes(self, bus: Bus, read_after: float = -float("inf")) -> Routes | None:
        """Our node's routes, as read after `read_after` (monotonic) and at most ttl_s ago; None when
        unknown (no monitor, not connected to that node, no answer)."""
        if self.monitor_url is None or (node := bus.node) is None:
            return None
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.ttl_s or self._cached[0] < read_after:
            try:
                self._cached = (now, await asyncio.to_thread(self._read))
            except (OSError, ValueError, KeyError) as e:
                log.warning("cluster view: %s did not answer (%s)", self.monitor_url, e)
                return None
        routes = self._cached[1]
        host, _, port = node.rpartition(":")
        listen_host, listen_port = routes.node
        same = int(port) == listen_port and (host == listen_host or listen_host in ANY_ADDRESS)
        return routes if same else None

    def _read(self) -> Routes:
        with urllib.request.urlopen(f"{self.monitor_url}/varz", timeout=1) as r:
            varz = json.loads(r.read())
        with urllib.request.urlopen(f"{self.monitor_url}/routez", timeout=1) as r:
            routez = json.loads(r.read())
        now = datetime.fromisoformat(routez["now"])
        settled = (x["ip"] for x in routez.get("routes") or ()
                   if (now - datetime.fromisoformat(x["start"])).total_seconds() >= ROUTE_SETTLE_S)
        return Routes((varz["host"], int(varz["port"])), frozenset(settled))

    async def cut_off(self, bus: Bus, node: str | None, seen_at: float) -> bool:
        """True when `node` ("host:port", a heartbeat's bus_node) is on another host than ours and
        our node had no route to that host at `seen_at` or since (the routes are read after it: the
        server drops a route's subscriptions and the route together, so a "no responders" seen
        at `seen_at` is explained by routes read after it)."""
        if node is None or node == bus.node or (routes := await self.routes(bus, seen_at)) is None:
            return False
        ip = await self._ip(node.rpartition(":")[0])
        own = await self._ip(bus.node.rpartition(":")[0]) if bus.node else None
        return ip is not None and ip != own and ip not in routes.peers

    async def _ip(self, host: str) -> str | None:
        if host not in self._ips:
            try:
                infos = await asyncio.to_thread(socket.getaddrinfo, host, None, type=socket.SOCK_STREAM)
            except OSError:
                return None
            self._ips[host] = infos[0][4][0]
        return self._ips[host]
