"""A partition seen from inside (shared/cluster_view.py, shared/liveness.py), against a stand-in of
nats-server's monitoring endpoint, and the files `moebus bus-files` writes (shared/bus_hosts.py)."""
from __future__ import annotations

import asyncio
import json
import math
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moebus.services.frontend.fleet.fleet import FleetView
from moebus.services.worker.leases import FrontendLeases
from moebus.shared.bus_auth import load_credentials
from moebus.shared.bus_hosts import BusHost, BusLayout, bus_files
from moebus.shared.cluster_view import ClusterView
from moebus.shared.errors import NoResponders
from moebus.shared.liveness import probe
from moebus.shared.messages import GenerateRequest, Heartbeat, SamplingOptions
from moebus.shared.subjects import Subjects


class Monitor:
    """/varz and /routez of a node listening on 10.9.1.2:4222, its routes as set."""

    def __init__(self) -> None:
        self.peers = ["10.9.2.2", "10.9.3.2"]
        self.new = ""  # a peer whose route was made just now
        self.reads = 0
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                monitor.reads += 1
                routes = [{"remote_name": p, "ip": p, "port": 6222,
                           "start": "2026-12-07T00:23:34.3Z" if p == monitor.new else "2026-12-07T00:20:00.0Z"}
                          for p in monitor.peers]
                body = ({"host": "10.9.1.2", "port": 4222, "server_name": "a"} if self.path == "/varz" else
                        {"now": "2026-12-07T00:23:35.301985941Z", "routes": routes})
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def monitor():
    m = Monitor()
    yield m
    m.server.shutdown()


class FakeBus:
    """What the view, probe and leases use of a Bus: the node we are on, a request that finds nobody."""

    evidence_since = -math.inf  # we hear fine

    def __init__(self, node: str | None = "10.9.1.2:4222") -> None:
        self.node = node

    async def request(self, *_: object, **__: object) -> None:
        raise NoResponders("no responders")

    async def flush(self, timeout: float) -> None:
        pass


async def test_a_peer_on_a_host_our_node_routes_to_is_not_cut_off(monitor: Monitor) -> None:
    view, bus = ClusterView(monitor.url, ttl_s=0), FakeBus()
    assert not await view.cut_off(bus, "10.9.2.2:4222", time.monotonic())
    assert not await view.cut_off(bus, "10.9.1.2:4222", time.monotonic())  # our own node
    assert not await view.cut_off(bus, None, time.monotonic())  # an old heartbeat without its node
    monitor.peers = ["10.9.3.2"]  # the route to b went
    assert await view.cut_off(bus, "10.9.2.2:4222", time.monotonic())
    assert not await view.cut_off(bus, "10.9.3.2:4222", time.monotonic())
    monitor.peers, monitor.new = ["10.9.2.2", "10.9.3.2"], "10.9.2.2"  # back 1 s ago: b's interest may not be here yet
    assert await view.cut_off(bus, "10.9.2.2:4222", time.monotonic())


async def test_the_view_is_unknown_off_its_node_or_without_an_answer(monitor: Monitor) -> None:
    monitor.peers = []
    # connected to another node than the monitored one (a reconnect elsewhere): nothing is cut off
    assert not await ClusterView(monitor.url).cut_off(FakeBus("10.9.3.2:4222"), "10.9.2.2:4222", 0.0)
    assert not await ClusterView(None).cut_off(FakeBus(), "10.9.2.2:4222", 0.0)  # no monitor
    assert not await ClusterView("http://127.0.0.1:9").cut_off(FakeBus(), "10.9.2.2:4222", 0.0)  # no answer
    assert not await ClusterView(monitor.url).cut_off(FakeBus(None), "10.9.2.2:4222", 0.0)  # we are down


async def test_routes_are_read_after_the_no_responders_they_explain(monitor: Monitor) -> None:
    view, bus = ClusterView(monitor.url, ttl_s=60), FakeBus()
    assert not await view.cut_off(bus, "10.9.2.2:4222", time.monotonic())
    monitor.peers = ["10.9.3.2"]
    reads = monitor.reads
    assert await view.cut_off(bus, "10.9.2.2:4222", time.monotonic())  # within ttl, yet read again
    assert monitor.reads == reads + 2
    assert await view.cut_off(bus, "10.9.2.2:4222", -math.inf)  # an older question: the cache answers
    assert monitor.reads == reads + 2


async def test_probe_says_unreachable_across_a_partition_until_the_grace_ends(monitor: Monitor) -> None:
    view, bus, s = ClusterView(monitor.url, ttl_s=0), FakeBus(), Subjects()
    monitor.peers = ["10.9.3.2"]
    now = time.monotonic()
    kw = {"view": view, "silent_since": now - 10, "grace_s": 60}
    assert await probe(bus, s, "worker", "w", 0.1, node="10.9.2.2:4222", **kw) == "unreachable"
    assert await probe(bus, s, "worker", "w", 0.1, node="10.9.3.2:4222", **kw) == "gone"  # routed: it died
    assert await probe(bus, s, "worker", "w", 0.1, node="10.9.2.2:4222", view=view, silent_since=now - 61,
                       grace_s=60) == "gone"  # silent past the grace: its host is taken as gone
    assert await probe(bus, s, "worker", "w", 0.1, node="10.9.2.2:4222") == "gone"  # no view: as before


def _beat(instance: str, incarnation: str = "one", service: str = "worker", node: str | None = None) -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance, ts=0, interval_s=1.0, incarnation=incarnation,
                     bus_node=node)


async def test_a_worker_keeps_the_requests_of_a_frontend_across_a_partition(monitor: Monitor) -> None:
    """Its lease lapses, its health has no responders, but its node is on a host ours lost: kept
    (replayed after the heal); the same silence from a frontend on a routed host aborts."""
    monitor.peers = ["10.9.3.2"]
    aborted: list[str] = []

    async def abort(rid: str) -> None:
        aborted.append(rid)

    for node, grace, want in (("10.9.2.2:4222", 60.0, []), ("10.9.3.2:4222", 60.0, ["r"]),
                              ("10.9.2.2:4222", 0.0, ["r"])):
        aborted.clear()
        leases = FrontendLeases(lease_s=0.05, view=ClusterView(monitor.url, ttl_s=0), grace_s=grace)
        leases.observe(_beat("frontend-0", "f", "frontend", node), time.monotonic())
        req = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1], params=SamplingOptions(),
                              reply_to="x", frontend_id="frontend-0", frontend_incarnation="f")
        task = asyncio.create_task(leases.run(FakeBus(), Subjects(), lambda r=req: [r], abort, 0.05))
        if want:
            async with asyncio.timeout(5):
                while not aborted:
                    await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(0.4)  # eight lease rounds: none may abort
        task.cancel()
        assert aborted[:1] == want, (node, grace)


def test_a_worker_heard_again_after_a_silence_is_told_once() -> None:
    now = [0.0]
    back: list[str] = []
    fleet = FleetView(clock=lambda: now[0], on_return=lambda b: back.append(b.instance_id))
    fleet.observe(_beat("w"))
    now[0] = 1.0
    fleet.observe(_beat("w"))  # on time
    now[0] = 10.0
    fleet.observe(_beat("w"))  # after 9 s of silence: the same process is back
    now[0] = 11.0
    fleet.observe(_beat("w"))
    now[0] = 20.0
    fleet.observe(_beat("w", "two"))  # a restart is not a return: what the old one held is gone
    assert back == ["w"]


def test_bus_files_make_one_node_per_host_and_private_credentials(tmp_path) -> None:
    layout = BusLayout([BusHost.parse("a=10.0.0.1"), BusHost.parse("b=10.0.0.2")])
    files = bus_files(layout, tmp_path / "bus")
    conf = files["b"].read_text()
    assert 'listen: "10.0.0.2:4222"' in conf and 'http: "127.0.0.1:8222"' in conf
    assert "10.0.0.1:6222" in conf and "10.0.0.2:6222" not in conf.split("routes:")[1]  # routes to the others
    assert "pool_size: -1" in conf
    for path in files.values():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "bus").stat().st_mode) == 0o700
    worker = load_credentials(files["worker"], "worker-b0")  # any instance takes the "*" entry
    assert worker.password in files["a"].read_text() and worker.password in conf  # every node knows every user
    assert layout.url("a") == "nats://10.0.0.1:4222"
    with pytest.raises(ValueError, match="NAME=ADDRESS"):
        BusHost.parse("a")
    with pytest.raises(ValueError, match="repeat"):
        BusLayout([BusHost("a", "x"), BusHost("a", "y")])


def test_bus_files_cli(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "bus-files", "--out", str(tmp_path / "f"), "--host",
                          "a=10.0.0.1", "--host", "b=10.0.0.2", "--host", "c=10.0.0.3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {line.split(":")[0] for line in out.stdout.splitlines()} >= {"a", "b", "c", "worker", "admin"}
    bad = subprocess.run([sys.executable, "-m", "moebus.cli", "bus-files", "--out", str(tmp_path / "g"), "--host",
                          "a"], capture_output=True, text=True)
    assert bad.returncode != 0 and "NAME=ADDRESS" in bad.stderr
