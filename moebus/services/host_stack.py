"""The stack as several hosts (issue #40): a nats-server node and `moebus serve` processes per host.

Each host is a network namespace (services/netns.py). The operator's files come from
shared/bus_hosts.py (every node's nats.conf: authenticated routes, the users; one credentials
file per role), and every service is started as docs/multihost.md tells an operator to: `moebus
serve <service> --nats-url <its host's node>` with $MOEBUS_NATS_CREDS naming its role's file. Only
addresses inside the namespaces are used; `stop()` removes processes, namespaces and files.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import BaseModel

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import CREDS_ENV, SERVICE_ROLES
from moebus.shared.bus_hosts import BusHost, BusLayout, bus_files
from moebus.shared.config_cli import to_cli_args
from moebus.shared.messages import HealthReply
from moebus.shared.nats_server import find_nats_server
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .netns import Hosts

T = TypeVar("T")
METRICS_PORT = 9100  # + the process's index: each service's /metrics on its host's loopback


@dataclass(frozen=True)
class Process:
    """One service process: `moebus serve <service>` on `host` with its config's flags."""

    host: str
    service: str
    config: BaseModel  # the service's config (instance_id, its fields); nats_url is set here

    @property
    def instance_id(self) -> str:
        return self.config.instance_id  # type: ignore[attr-defined]


@dataclass
class HostStack:
    hosts: Sequence[str]
    processes: Sequence[Process]
    log_dir: str
    ready_timeout_s: float = 120.0
    net: Hosts = field(init=False)
    layout: BusLayout = field(init=False)
    files: dict[str, Path] = field(default_factory=dict, init=False)
    procs: dict[str, Any] = field(default_factory=dict, init=False)  # instance id -> Popen
    configs: dict[str, BaseModel] = field(default_factory=dict, init=False)  # instance id -> config as started
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.net = Hosts(list(self.hosts))
        self.layout = BusLayout([BusHost(h, self.net.address(h)) for h in self.hosts])

    # -- addresses ----------------------------------------------------------------------------------
    def node_url(self, host: str) -> str:
        return self.layout.url(host)

    def process(self, instance_id: str) -> Process:
        return next(p for p in self.processes if p.instance_id == instance_id)

    def frontend_url(self, instance_id: str) -> str:
        cfg = self.configs[instance_id]
        return f"http://{cfg.host}:{cfg.port}"  # type: ignore[attr-defined]

    def metrics_url(self, instance_id: str) -> str:
        if self.process(instance_id).service == "frontend":  # on its API port
            return self.frontend_url(instance_id) + "/metrics"
        return f"http://127.0.0.1:{self.configs[instance_id].http_port}/metrics"  # type: ignore[attr-defined]

    def metric(self, instance_id: str, name: str, labels: str = "") -> float:
        """The sum of a metric's series whose labels contain `labels`, read on the instance's host."""
        url = self.metrics_url(instance_id)

        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode()

        text = self.net.run_in(self.host_of(instance_id), get)
        return sum(float(v) for lb, v in re.findall(rf"^{name}(?:{{(.*)}})? (\S+)$", text, re.M) if labels in lb)

    def host_of(self, instance_id: str) -> str:
        return self.process(instance_id).host

    # -- life -----------------------------------------------------------------------------------------
    def start(self) -> Self:
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="moebus-hosts-")
        try:
            self.net.start()
            self.files = bus_files(self.layout, self._tmp.name)
            for h in self.hosts:
                self.procs[f"nats-{h}"] = self.net.popen(h, [find_nats_server(), "-c", str(self.files[h])],
                                                         log=f"{self.log_dir}/nats-{h}.log")
            for h in self.hosts:
                self._until_listening(h)
            self.until_routed()
            for p in self.processes:
                self.spawn(p)
            self.run_async(self.hosts[0], self.until_ready)
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self, p: Process) -> None:
        update = {"nats_url": self.node_url(p.host), "nats_monitor_url": f"http://127.0.0.1:{self.layout.monitor_port}"}
        if p.service == "frontend":  # the API on its host's address
            update["host"] = self.net.address(p.host)
        elif getattr(p.config, "http_port", None) is None:  # its /metrics, on its host's loopback
            update |= {"http_port": METRICS_PORT + list(self.processes).index(p), "http_host": "127.0.0.1"}
        cfg = p.config.model_copy(update=update)
        self.configs[p.instance_id] = cfg
        role = p.service if p.service in SERVICE_ROLES else "worker"  # prefill, decode: worker users
        env = {**os.environ, CREDS_ENV: str(self.files[role])}
        cmd = [sys.executable, "-m", "moebus.cli", "serve", p.service, *to_cli_args(cfg)]
        self.procs[p.instance_id] = self.net.popen(p.host, cmd, env=env, log=f"{self.log_dir}/{p.instance_id}.log")

    def _until_listening(self, host: str, timeout: float = 10.0) -> None:
        addr = (self.net.address(host), self.layout.client_port)

        def probe() -> None:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(addr, timeout=0.2).close()
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"nats-server on {host} did not listen on {addr}") from None
                    time.sleep(0.05)

        self.net.run_in(host, probe)

    def routes(self, host: str) -> set[str]:
        """The nodes `host`'s node has a route to now (its /routez, on the host's loopback)."""
        url = f"http://127.0.0.1:{self.layout.monitor_port}/routez"

        def get() -> set[str]:
            with urllib.request.urlopen(url, timeout=2) as r:
                return {x["remote_name"] for x in json.loads(r.read())["routes"]}

        return self.net.run_in(host, get)

    def until_routed(self, timeout: float = 60.0) -> float:
        """Until every node routes to every other; returns the seconds it took."""
        started = time.monotonic()
        for h in self.hosts:
            want = set(self.hosts) - {h}
            while self.routes(h) != want:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"node {h} routes to {sorted(self.routes(h))}, not {sorted(want)}")
                time.sleep(0.1)
        return time.monotonic() - started

    def admin(self, name: str, host: str) -> BusConfig:
        return BusConfig(servers=[self.node_url(host)], name=name, credentials=str(self.files["admin"]))

    async def until_ready(self) -> None:
        """Every service answers `ready`, each balancer sees every worker, each frontend's /ready is 200
        (run on the first host)."""
        bus = await Bus.connect(self.admin("hoststack", self.hosts[0]), Tracing("hoststack"))
        subjects, deadline = Subjects(), time.monotonic() + self.ready_timeout_s
        try:
            for p in self.processes:
                while True:
                    if (code := self.procs[p.instance_id].poll()) is not None:
                        raise RuntimeError(f"{p.instance_id} exited with {code} (log: {self.log_dir})")
                    try:
                        await bus.request(subjects.ready(p.service, p.instance_id), Empty(), HealthReply, timeout=0.5)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{p.instance_id} not ready (log: {self.log_dir})") from None
                        await asyncio.sleep(0.2)
            workers = {p.instance_id for p in self.processes if p.service in ("worker", "prefill", "decode")}
            for b in (p.instance_id for p in self.processes if p.service == "balancer"):
                while True:
                    stats = await bus.request(subjects.stats("balancer", b), Empty(), Stats, timeout=2)
                    if workers <= {w["worker_id"] for w in stats.stats["workers"] if w["ready"]}:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{b} does not see every worker")
                    await asyncio.sleep(0.1)
        finally:
            await bus.drain()
        for f in (p.instance_id for p in self.processes if p.service == "frontend"):
            while True:
                try:
                    with urllib.request.urlopen(self.frontend_url(f) + "/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{f}'s /ready is not 200")
                await asyncio.sleep(0.1)

    def run_async(self, host: str, fn: Callable[[], Awaitable[T]]) -> T:
        """fn() on an event loop of its own in `host`'s network namespace (blocks)."""
        return self.net.run_in(host, lambda: asyncio.run(fn()))  # type: ignore[arg-type]

    def stop(self) -> None:
        self.net.stop()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

