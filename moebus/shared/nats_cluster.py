"""A nats-server cluster on one host: N nodes with routes between them, one set of users.

One node is a plain server. Local twin of deploy/nats.yaml's StatefulSet (same cluster name, full mesh of routes, same
max_payload, users and permissions on every node); for `moebus up --nats-cluster N` and the tests.
Clients get every node's URL (`url`, comma-separated: ServiceConfig.nats_url takes that) and move
to another node when theirs goes; a message published on one node reaches subscribers on any.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from .nats_server import DEFAULT_MAX_PAYLOAD, ClusterRoutes, NatsServer
from .ports import free_port

CLUSTER_NAME = "moebus"  # deploy/nats.yaml's cluster name


@dataclass
class NatsCluster:
    size: int = 3
    host: str = "127.0.0.1"
    max_payload: int = DEFAULT_MAX_PAYLOAD
    authorization: dict | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    log_dir: str | None = None  # nats-<i>.log each
    ports: list[int] | None = None  # client ports (0: a free one); default: free ones
    jetstream: bool = False  # our services use none; deploy/ turns it on for operators
    die_with_parent: bool = False
    # Each node serves /connz, /routez (NatsServer.monitor_port, loopback: no secrets in them). Always
    # on for more than one node: start() waits on /routez for the full mesh, since a client on a node
    # whose routes are not up yet would miss what is published on the others (a lost stream head
    # leaves no gap to see).
    monitor: bool = False
    nodes: list[NatsServer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a cluster needs at least 1 node, got {self.size}")

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def start(self, timeout: float = 10.0) -> Self:
        ports = [p or free_port(self.host) for p in (self.ports or [0] * self.size)]
        routes = [free_port(self.host) for _ in range(self.size)]
        password = secrets.token_urlsafe(24)  # the routes' user, shared by the nodes
        try:
            for i in range(self.size):
                log_file = str(Path(self.log_dir) / f"nats-{i}.log") if self.log_dir else None
                cluster = None if self.size == 1 else ClusterRoutes(  # one node: a plain server
                    name=CLUSTER_NAME, server_name=f"nats-{i}", port=routes[i],
                    peers=tuple(f"{self.host}:{p}" for j, p in enumerate(routes) if j != i), password=password)
                self.nodes.append(NatsServer(
                    port=ports[i], host=self.host, jetstream=self.jetstream, log_file=log_file,
                    max_payload=self.max_payload, authorization=self.authorization, tls_cert=self.tls_cert,
                    tls_key=self.tls_key, cluster=cluster, die_with_parent=self.die_with_parent,
                    monitor_port=0 if self.monitor or self.size > 1 else None).start(timeout))
            for i in range(self.size):
                self._until_routed(i, timeout)
        except BaseException:
            self.stop()
            raise
        self.ports = ports
        return self

    def _until_routed(self, i: int, timeout: float) -> None:
        """Until node i has a route to every other node that is running."""
        node = self.nodes[i]
        if node.cluster is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            want = {n.cluster.server_name for j, n in enumerate(self.nodes) if j != i and n.poll() is None}
            with urllib.request.urlopen(f"http://{self.host}:{node.monitor_port}/routez", timeout=2) as r:
                have = {route.get("remote_name") for route in json.load(r).get("routes") or []}
            if want <= have:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-{i} has no route to {sorted(want - have)} after {timeout:g}s")
            time.sleep(0.05)

    def restart(self, i: int, down_s: float = 0.0) -> None:
        """Start node i again (after it died or was stopped): same ports, routes and users."""
        old = self.nodes[i]
        old.stop()
        time.sleep(down_s)
        self.nodes[i] = dataclasses.replace(old, store_dir=None, authorization=self.authorization).start()
        self._until_routed(i, 10.0)

    def reload(self, authorization: dict | None) -> None:
        """New users on every running node (connected clients stay)."""
        self.authorization = authorization
        for n in self.nodes:
            if n.poll() is None:
                n.reload(authorization)
            else:
                n.authorization = authorization  # used when it is restarted

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
