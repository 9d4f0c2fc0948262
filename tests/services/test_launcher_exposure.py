"""What `moebus up` exposes (issue 36 item 7): the API listens on --host, every other listener
(each process's /metrics and probes, nats-server's ports) on loopback; API keys reach the frontend
by a 0600 file in the launcher's private 0700 directory, never on a child's argv or in its
environment; the keys work."""
from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from pathlib import Path

import openai
import pytest

from moebus.services.frontend.admission.tenants import KeyRing
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, from /proc (no psutil)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return out


def _descendants(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(p) for p in kids.read_text().split()] if kids.exists() else []
    return found + [d for k in found for d in _descendants(k)]


async def test_keys_by_private_file_and_internal_listeners_on_loopback(tmp_path, monkeypatch) -> None:
    argv_key, file_key, env_key = (f"sk-{kind}-{secrets.token_hex(8)}" for kind in ("argv", "file", "env"))
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{file_key}\n\n")
    monkeypatch.setenv("MOEBUS_API_KEYS", env_key)  # deprecated: taken, and kept from the children
    cfg = StackConfig(port=free_port(), host="0.0.0.0", model="toy", heartbeat_interval_s=0.25,
                      api_keys=[argv_key], api_keys_file=str(keys_file), log_dir=str(tmp_path / "logs"),
                      ready_timeout_s=120)
    with Stack(cfg) as stack:
        nats = [n._proc.pid for n in stack.bus_nodes.nodes]
        children = {i: p.pid for i, p in stack.procs.items()}
        pids = [*children.values(), *nats]
        pids += [d for p in pids for d in _descendants(p)]
        for pid in pids:
            for what in ("environ", "cmdline"):
                text = Path(f"/proc/{pid}/{what}").read_bytes()
                for key in (argv_key, file_key, env_key):
                    assert key.encode() not in text, f"a key in /proc/{pid}/{what}"
        path = Path(stack._api_keys_file)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert str(path) in Path(f"/proc/{children['frontend-0']}/cmdline").read_bytes().decode()

        for key in (argv_key, file_key, env_key):
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
            r = await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
            assert r.choices[0].message.content == "He"
        for key in ("none", argv_key + "x"):
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                await client.models.list()
            assert e.value.status_code == 401

        for instance, pid in children.items():
            found = listening(pid)
            if instance == "frontend-0":  # the API, /metrics on its port, binds --host
                assert found == {("0.0.0.0", cfg.port)}, found
            else:
                assert found == {("127.0.0.1", stack.metrics_ports[instance][1])}, (instance, found)
        for pid in nats:  # clients, monitoring: loopback only
            found = listening(pid)
            assert found and {addr for addr, _ in found} == {"127.0.0.1"}, found
    assert not path.exists() and not path.parent.exists()  # the private directory went with the stack


def test_metrics_targets_follow_the_hosts() -> None:
    stack = Stack(StackConfig(host="10.1.2.3", port=8100, metrics_host="0.0.0.0"))
    stack.metrics_ports = {"frontend-0": ("frontend", 8100), "worker-0": ("worker", 9001)}
    assert [t["targets"] for t in stack.metrics_targets()] == [["10.1.2.3:8100"], ["127.0.0.1:9001"]]
    assert stack.url == "http://10.1.2.3:8100"


def test_a_keys_file_without_keys_still_locks(tmp_path) -> None:
    """An empty --api-key-file means nobody gets in, not auth off (fail closed)."""
    (tmp_path / "keys.txt").write_text("\n")
    stack = Stack(StackConfig(model="toy", api_keys_file=str(tmp_path / "keys.txt")))
    try:
        stack._write_api_keys()
        frontend = dict(stack.service_configs())["frontend"]
        assert frontend.api_keys_file == str(stack._api_keys_file) and stack._api_keys_file.read_text() == ""
        ring = KeyRing.from_config(frontend)
        assert ring.required and ring.tenant("") is None and ring.tenant("anything") is None
    finally:
        stack.stop()
