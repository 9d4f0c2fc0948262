"""Ports the launcher assigns come from below the kernel's ephemeral range, where no outgoing
connection can take one between the choice and the child's bind (shared/ports.py)."""
from __future__ import annotations

import socket
from collections import deque
from pathlib import Path

import pytest

from moebus.shared.ports import SPAN, ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low = ephemeral_low()
    if low is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    for _ in range(20):
        port = free_port()
        assert low - SPAN <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: this would raise


def test_a_taken_port_is_not_handed_out(monkeypatch) -> None:
    import moebus.shared.ports as ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if port - 1 < 1024 + 1000:
            pytest.skip("the kernel gave a port too low for this check")
        monkeypatch.setattr(ports, "SPAN", 1)  # the span below `port + 1` is the taken port alone
        assert free_port(ephemeral_from=port + 1) != port  # every try failed: the kernel picked


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_low(f) == 40000
    assert ephemeral_low(tmp_path / "missing") is None
    f.write_text("garbage")
    assert ephemeral_low(f) is None


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(monkeypatch) -> None:
    """A launcher picks every child's port before any binds: two picks must differ (here the span
    is 30 ports, so 25 random picks would repeat one almost surely without the memory)."""
    import moebus.shared.ports as ports

    low = ephemeral_low()
    if low is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    monkeypatch.setattr(ports, "SPAN", 30)
    monkeypatch.setattr(ports, "_handed", deque(maxlen=512))
    picks = [free_port() for _ in range(25)]
    assert len(set(picks)) == 25
