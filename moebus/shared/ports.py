"""Free TCP ports for processes a launcher (or a test) starts and tells which port to listen on.

A port that the kernel hands out when asked for "any port" comes from its ephemeral range, the one
it also gives outgoing connections their local ports from. Between choosing it and the child binding
it (a worker binds its probe port after loading its model: seconds later) any connection on the host
may take it: CI saw a worker die with EADDRINUSE that way. So the port is chosen, at random, from the
span just below that range, which the kernel never hands out by itself, and checked to be free now.
The ports this process handed out lately are not handed out again: a launcher picks a port for
each child before any of them binds, and two equal random picks would collide just the same.
"""
from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SPAN = 10000  # ports below the ephemeral range to choose from
TRIES = 64
# Process-wide on purpose: ports are a host-wide resource, and every caller in this process shares it.
_handed: deque[int] = deque(maxlen=512)


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int | None:
    """The first port of the kernel's ephemeral range (Linux), None where it cannot be read."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, ephemeral_from: int | None = None) -> int:
    """A port nothing on `host` listens on now, below the ephemeral range where that is known
    (`ephemeral_from` overrides the kernel's); else (and after TRIES taken ones) one the kernel picks."""
    low = ephemeral_from if ephemeral_from is not None else ephemeral_low()
    if low is not None and low > 1024 + 1000:
        rng = random.Random()  # (its own generator: nobody's seeded global sequence is consumed)
        for _ in range(TRIES):
            port = rng.randrange(max(1024, low - SPAN), low)
            if port not in _handed and _bindable(host, port):
                _handed.append(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
