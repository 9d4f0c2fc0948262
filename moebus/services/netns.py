"""Hosts on one machine: a Linux network namespace each, joined through a router namespace.

For tests and measurements of what crosses a network (issue #40). Each host gets a veth link to
the router, its own /24 (host .2, router .1) and a default route through the router, which
forwards between them. Nothing is added to the caller's own namespace: a test reaches a host's
addresses from a thread that entered that host's namespace (`run_in`).

Faults live in the router, so every host keeps its link up and its own addresses, as on a real
switch failure: a packet that may not pass is dropped in transit (policy rules of type
blackhole: no netfilter needed), and TCP on both ends only sees silence.
- `cut(h)`: h reaches no other host (its own processes and node still talk to each other);
- `split(a, b)`: a and b cannot reach each other, everyone else still reaches both.
`heal` / `unsplit` take the rule back. Needs root (CAP_NET_ADMIN) and iproute2.
"""
from __future__ import annotations

import ctypes
import os
import re
import secrets
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

from moebus.shared.lifeline import die_with_parent

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _remove_orphans() -> None:
    """Namespaces of runs whose process is gone (killed before stop()): theirs, by the pid in the tag."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if (m := re.match(r"mb(\d+)x[0-9a-f]{4}-", name)) and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def enter(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (threads and processes it starts later
    inherit it): the way into a host for code that is not a command line."""
    with open(f"/run/netns/{ns}") as f:
        if ctypes.CDLL(None, use_errno=True).setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")


@dataclass(frozen=True)
class InNamespaces:
    """Per-process setup for a launcher (picklable): process i enters `namespaces[i]`, and its
    collectives use `ifname` there (gloo and NCCL otherwise take the hostname's address, which
    names no interface inside a namespace)."""

    namespaces: tuple[str, ...]
    ifname: str = "eth0"

    def __call__(self, i: int) -> None:
        enter(self.namespaces[i])
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = self.ifname
        # NCCL would see one host (same hostname and boot id) and pass tensors over shared memory or
        # P2P; a host id per namespace makes it use its network transport, as between machines.
        os.environ["NCCL_HOSTID"] = self.namespaces[i]


def available() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"mbprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, FileNotFoundError) as e:
        return f"cannot make a network namespace: {e}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    names: Sequence[str]
    tag: str = field(default_factory=lambda: f"mb{os.getpid()}x{secrets.token_hex(2)}")  # namespaces of this run
    net: int = field(default_factory=lambda: 16 + secrets.randbelow(200))  # 10.<net>.<i>.0/24
    _made: list[str] = field(default_factory=list, init=False)
    _rules: set[tuple[str, ...]] = field(default_factory=set, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)

    @property
    def router(self) -> str:
        return f"{self.tag}-router"

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"10.{self.net}.{list(self.names).index(host) + 1}.2"

    def start(self) -> Self:
        _remove_orphans()
        try:
            self._add(self.router)
            _ip("link", "set", "lo", "up", ns=self.router)
            subprocess.run(["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
            for i, host in enumerate(self.names, 1):
                ns, port = self.ns(host), f"{self.tag}r{i}"
                self._add(ns)
                _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", port, "netns", self.router)
                _ip("addr", "add", f"10.{self.net}.{i}.1/24", "dev", port, ns=self.router)
                _ip("link", "set", port, "up", ns=self.router)
                _ip("addr", "add", f"{self.address(host)}/24", "dev", "eth0", ns=ns)
                for dev in ("lo", "eth0"):
                    _ip("link", "set", dev, "up", ns=ns)
                _ip("route", "add", "default", "via", f"10.{self.net}.{i}.1", ns=ns)
        except BaseException:
            self.stop()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    # -- faults -----------------------------------------------------------------------------------
    def _rule(self, on: bool, *selector: str) -> None:
        if on == (selector in self._rules):
            return
        _ip("rule", "add" if on else "del", *selector, "blackhole", ns=self.router)
        (self._rules.add if on else self._rules.discard)(selector)

    def cut(self, host: str) -> None:
        a = self.address(host)
        self._rule(True, "from", a)
        self._rule(True, "to", a)

    def heal(self, host: str) -> None:
        a = self.address(host)
        self._rule(False, "from", a)
        self._rule(False, "to", a)

    def split(self, a: str, b: str) -> None:
        x, y = self.address(a), self.address(b)
        self._rule(True, "from", x, "to", y)
        self._rule(True, "from", y, "to", x)

    def unsplit(self, a: str, b: str) -> None:
        x, y = self.address(a), self.address(b)
        self._rule(False, "from", x, "to", y)
        self._rule(False, "from", y, "to", x)

    def heal_all(self) -> None:
        for selector in list(self._rules):
            self._rule(False, *selector)

    # -- processes ----------------------------------------------------------------------------------
    def popen(self, host: str, cmd: Sequence[str], env: dict[str, str] | None = None, log: str | None = None,
              **kw: Any) -> subprocess.Popen:
        """`cmd` on `host` (`ip netns exec` execs it: the pid is the command's). Stopped by stop()."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent(), **kw)
        self._procs.append(proc)
        return proc

    def run_in(self, host: str, fn: Callable[[], T]) -> T:
        """fn() in a thread that entered `host`'s network namespace: sockets it opens live there."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                enter(self.ns(host))
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        t = threading.Thread(target=target, name=f"netns-{host}")
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self, timeout: float = 10.0) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        for ns in reversed(self._made):  # a namespace takes its veth ends and rules with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self._rules.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
