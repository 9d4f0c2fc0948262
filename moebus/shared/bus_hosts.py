"""One bus across hosts: the files an operator copies to each machine.

A stack on several machines runs one nats-server node per host, joined into one cluster by
authenticated routes (deploy/nats.yaml's shape without Kubernetes). `bus_files` writes, for hosts
named with their addresses:
- `<host>/nats.conf`: the node's client listener on the host's address, its monitoring on the
  host's loopback, the users and their permissions (shared.bus_auth), and routes to every other
  node with the routes' own password (a route port takes no client users);
- `creds/<role>.json`: one credentials file per role (any instance of it), for $MOEBUS_NATS_CREDS.
Every file is 0600 in a 0700 directory: they hold passwords. docs/multihost.md says which file goes
where and what each host runs.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from .bus_auth import ROLES, BusUsers, write_credentials
from .nats_server import DEFAULT_MAX_PAYLOAD, ClusterRoutes
from .subjects import Subjects, check_token

CLIENT_PORT = 4222  # nats-server's own defaults, as deploy/nats.yaml uses them
ROUTE_PORT = 6222
MONITOR_PORT = 8222


@dataclass(frozen=True)
class BusHost:
    name: str  # the node's server_name, and its folder
    address: str  # where the other hosts and this host's services reach it

    @classmethod
    def parse(cls, text: str) -> BusHost:
        """`NAME=ADDRESS`, e.g. `a=10.0.0.1`."""
        name, sep, address = text.partition("=")
        if not sep or not address:
            raise ValueError(f"a host is NAME=ADDRESS, e.g. a=10.0.0.1, got {text!r}")
        return cls(check_token(name), address)


@dataclass
class BusLayout:
    hosts: list[BusHost]
    subjects: Subjects = field(default_factory=Subjects)
    client_port: int = CLIENT_PORT
    route_port: int = ROUTE_PORT
    monitor_port: int | None = MONITOR_PORT  # on the host's loopback; None: off
    max_payload: int = DEFAULT_MAX_PAYLOAD
    cluster_name: str = "moebus"

    def __post_init__(self) -> None:
        names = [h.name for h in self.hosts]
        if not names:
            raise ValueError("a bus needs at least one host")
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")

    def url(self, host: str) -> str:
        """The URL a service on `host` joins the bus by: its own node."""
        return f"nats://{self._host(host).address}:{self.client_port}"

    def _host(self, name: str) -> BusHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r}; hosts: {[h.name for h in self.hosts]}")

    def node_config(self, host: str, users: BusUsers, route_password: str) -> str:
        h = self._host(host)
        lines = [f"server_name: {json.dumps(h.name)}", f"listen: {json.dumps(f'{h.address}:{self.client_port}')}",
                 f"max_payload: {self.max_payload}",
                 # A route whose peer stopped answering goes after 2-3 pings of 2 s (default: 2 x 2 min), and
                 # comes back within ~1 s of the heal; a route kept through a long cut waits instead on
                 # TCP's backed-off retransmits (measured: 6-8 s after a 20 s cut).
                 "ping_interval: \"2s\"", "ping_max: 2"]
        if self.monitor_port is not None:
            lines.append(f"http: {json.dumps(f'127.0.0.1:{self.monitor_port}')}")
        lines.append(f"authorization: {json.dumps(users.authorization())}")
        if len(self.hosts) > 1:
            # One route per pair of nodes, not a pool: a pool's connections fail one by one, and the one
            # carrying our account's interest can go while /routez still lists the others, so a
            # partition would read as a death for a moment (shared/cluster_view.py).
            routes = ClusterRoutes(name=self.cluster_name, server_name=h.name, port=self.route_port,
                                   peers=tuple(f"{o.address}:{self.route_port}" for o in self.hosts if o != h),
                                   password=route_password, pool_size=-1)
            lines.append(routes.config(h.address))
        return "\n".join(lines) + "\n"


def _private(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def bus_files(layout: BusLayout, out: str | Path) -> dict[str, Path]:
    """Write every host's nats.conf and every role's credentials under `out`, fresh passwords.
    Returns {"<host>": its nats.conf, "<role>": its creds file}."""
    out = _private(Path(out))
    users = BusUsers(layout.subjects)
    creds = {role: users.add(role) for role in ROLES}
    route_password = secrets.token_urlsafe(24)
    written: dict[str, Path] = {}
    for h in layout.hosts:
        conf = _private(out / h.name) / "nats.conf"
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(layout.node_config(h.name, users, route_password))
        written[h.name] = conf
    cdir = _private(out / "creds")
    for role, c in creds.items():
        written[role] = write_credentials(cdir / f"{role}.json", {"*": c})
    return written
