"""The fleet view behind `moebus status` and the frontend's fleet gauges, without processes: the
states an instance goes through (fake clock), the gauges' round trip through Prometheus text, the
command's table, JSON and errors; then the toy stack over a real bus."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from moebus.services.frontend.fleet.fleet import FleetView
from moebus.services.status import fetch, metrics_url, read_targets, run, table, with_targets
from moebus.shared.fleet_status import InstanceStatus, from_text, to_families
from moebus.shared.load_rates import LoadRates
from moebus.shared.messages import Heartbeat, Load
from moebus.shared.nats_server import free_port

from .conftest import ToyStack

STATUS = web.AppKey("status", int)  # what a fake process's /readyz answers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(instance: str, service: str = "worker", ts: float = 0.0, **kw) -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance, ts=ts, interval_s=1.0, **kw)


def test_states_restarts_and_load() -> None:
    clock = Clock()
    fleet = FleetView(clock, forget_after_s=60)
    fleet.observe(beat("tokenizer-0", "tokenizer"))
    fleet.observe(beat("worker-0", ready=False, load=Load()))
    assert [(r.instance_id, r.state) for r in fleet.rows()] == [("tokenizer-0", "ready"), ("worker-0", "starting")]
    for k in range(3):  # 10 tokens a second; 30 of 120 prompt tokens found cached
        clock.now += 1
        fleet.observe(beat("worker-0", ts=k, load=Load(num_running=2, num_waiting=1, kv_blocks_free=75,
                                                         kv_blocks_total=100, output_tokens_total=10 * k,
                                                         prefix_cache_queries_total=120, prefix_cache_hits_total=30,
                                                         ttft_p50_s=0.1, ttft_p90_s=0.2)))
    w = {r.instance_id: r for r in fleet.rows()}["worker-0"]
    assert (w.state, w.running, w.waiting, w.kv_usage, w.prefix_cache_hit_rate) == ("ready", 2, 1, 0.25, 0.25)
    assert w.output_tokens_per_s == 10 and (w.ttft_p50_s, w.ttft_p90_s, w.itl_p50_s) == (0.1, 0.2, None)
    assert [b.instance_id for b in fleet.live("worker")] == ["worker-0"]
    clock.now += 3.5  # silent for 3 beats: missing, and its old load is not shown
    rows = {r.instance_id: r for r in fleet.rows()}
    assert rows["worker-0"].state == "missing" and rows["worker-0"].running is None
    assert rows["tokenizer-0"].state == "missing" and not list(fleet.live("worker"))
    fleet.observe(beat("worker-0", ts=9, ready=False, restarts=1, load=Load()))  # the supervisor's restart
    fleet.observe(beat("tokenizer-0", "tokenizer", draining=True))
    rows = {r.instance_id: r for r in fleet.rows()}
    assert (rows["worker-0"].state, rows["worker-0"].restarts, rows["worker-0"].output_tokens_per_s) == \
        ("starting", 1, 0)
    assert rows["tokenizer-0"].state == "draining"
    clock.now += 4  # a draining instance that goes silent left on purpose: dropped
    assert [r.instance_id for r in fleet.rows()] == ["worker-0"]
    clock.now += 61  # missing for longer than forget_after_s: dropped too
    assert fleet.rows() == []


def test_load_rates_start_over_on_a_restart() -> None:
    rates = LoadRates(window_s=10)
    for k in range(4):
        rates.add(k, Load(requests_total=k, output_tokens_total=5 * k))
    assert rates.rates() == (1, 0, 5)
    rates.add(4, Load(requests_total=0))  # counters went down: a new process
    assert rates.rates() == (0, 0, 0)


ROWS = [InstanceStatus(instance_id="worker-0", service="worker", state="ready", restarts=1, heartbeat_age_s=0.2,
                       running=3, waiting=0, kv_usage=0.5, prefix_cache_hit_rate=0.75, output_tokens_per_s=12.5,
                       ttft_p50_s=0.1, ttft_p90_s=0.3, itl_p50_s=0.01, itl_p90_s=0.02),
        InstanceStatus(instance_id="balancer-0", service="balancer", state="starting", heartbeat_age_s=1.0)]


class _Rows:
    def collect(self):
        return to_families(ROWS)


def test_gauges_round_trip_through_prometheus_text() -> None:
    registry = CollectorRegistry()
    registry.register(_Rows())
    text = generate_latest(registry).decode()
    assert 'moebus_frontend_fleet_requests_running{worker="worker-0"} 3.0' in text
    assert 'moebus_frontend_fleet_state{member="balancer-0",member_service="balancer",state="starting"} 1.0' in text
    assert from_text(text) == sorted(ROWS, key=lambda r: r.service)
    with pytest.raises(ValueError, match="no moebus_frontend_fleet_state"):  # another server's page
        from_text("# TYPE up gauge\nup 1\n")


def test_table_json_and_targets(tmp_path) -> None:
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([{"targets": ["127.0.0.1:1"], "labels": {"service": "tokenizer",
                                                                          "instance_id": "tokenizer-0"}},
                                   {"targets": ["127.0.0.1:2"], "labels": {"service": "worker",
                                                                          "instance_id": "worker-0"}}]))
    rows = with_targets(ROWS, read_targets(str(targets)))
    assert [(r.instance_id, r.state) for r in rows] == [("balancer-0", "starting"), ("tokenizer-0", "missing"),
                                                       ("worker-0", "ready")]
    lines = table(rows).splitlines()
    assert lines[0].split()[:4] == ["INSTANCE", "SERVICE", "STATE", "RESTARTS"]
    assert lines[3].split() == ["worker-0", "worker", "ready", "1", "3", "0", "12.5", "50.0%", "75.0%", "100/300",
                                "10/20", "0.2s", "ago"]
    assert "never" in lines[2]
    assert table([]).splitlines()[1] == "(no instance heard yet: the stack is starting)"
    assert metrics_url("http://h:8000/v1/") == metrics_url("http://h:8000") == "http://h:8000/metrics"


def test_a_dead_url_is_one_line_and_exit_code_1() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "status", "--url", url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    err = io.StringIO()
    args = argparse.Namespace(url=url, targets=None, json=False, watch=None, timeout=1.0)
    assert run(args, out=io.StringIO(), err=err) == 1 and err.getvalue().startswith("moebus status: cannot reach")


async def test_without_the_frontend_each_process_probe_gives_its_state(tmp_path) -> None:
    """A stack starting (the frontend starts last) or partly down, with the targets file."""
    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({}, status=request.app[STATUS])

    runners, targets = [], []
    try:
        for name, status in (("tokenizer-0", 200), ("worker-0", 503)):
            app = web.Application()
            app[STATUS] = status
            app.router.add_get("/readyz", readyz)
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            targets.append({"targets": [f"127.0.0.1:{port}"], "labels": {"service": name[:-2], "instance_id": name}})
        dead = free_port()
        targets.append({"targets": [f"127.0.0.1:{dead}"], "labels": {"service": "frontend", "instance_id": "frontend-0"}})
        (tmp_path / "targets.json").write_text(json.dumps(targets))
        out, err = io.StringIO(), io.StringIO()
        args = argparse.Namespace(url=f"http://127.0.0.1:{dead}/v1", targets=str(tmp_path / "targets.json"), json=True,
                                  watch=None, timeout=1.0)
        assert await asyncio.to_thread(run, args, out, err) == 1  # the fleet gauges could not be read
    finally:
        for runner in runners:
            await runner.cleanup()
    rows = {r["instance_id"]: r["state"] for r in json.loads(out.getvalue())["instances"]}
    assert rows == {"frontend-0": "missing", "tokenizer-0": "ready", "worker-0": "starting"}
    assert "cannot reach" in err.getvalue() and "readiness probe" in err.getvalue()


@pytest.mark.parametrize("as_json", [False, True])
def test_watch_keeps_going_while_the_frontend_is_down(as_json: bool) -> None:
    out, err, naps = io.StringIO(), io.StringIO(), []

    def sleep(s: float) -> None:
        naps.append(s)
        if len(naps) == 2:
            raise KeyboardInterrupt

    args = argparse.Namespace(url=f"http://127.0.0.1:{free_port()}", targets=None, json=as_json, watch=0.5,
                              timeout=1.0)
    assert run(args, out=out, err=err, sleep=sleep) == 0 and naps == [0.5, 0.5]
    notes = err if as_json else out  # JSON lines stay JSON: the notes go to stderr
    assert notes.getvalue().count("cannot reach") == 2 and (out.getvalue() == "" if as_json else err.getvalue() == "")


async def test_the_frontend_exports_every_instance_of_the_toy_stack(stack: ToyStack) -> None:
    client = stack.client()
    await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=5)

    async def until(predicate: Callable[[list[InstanceStatus]], bool]) -> list[InstanceStatus]:
        async with asyncio.timeout(10):
            while not predicate(rows := await asyncio.to_thread(fetch, stack.base_url + "/v1", 5.0)):
                await asyncio.sleep(0.05)
        return rows

    every = {("tokenizer", "ready"), ("balancer", "ready"), ("worker", "ready"), ("frontend", "ready")}
    rows = await until(lambda rows: {(r.service, r.state) for r in rows} == every)
    [worker] = [r for r in rows if r.service == "worker"]
    assert worker.instance_id == "worker-0" and worker.running == 0 and worker.ttft_p50_s is not None
    async with aiohttp.ClientSession() as http, http.get(stack.base_url + "/metrics") as r:
        assert 'moebus_frontend_fleet_requests_waiting{worker="worker-0"}' in await r.text()
    await stack.workers[0].shutdown()  # its last beat says draining, then silence: it left on purpose
    await until(lambda rows: "worker-0" not in {r.instance_id for r in rows})
