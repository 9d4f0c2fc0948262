"""`moebus status` against `moebus up` on the real model, both through the real CLI: every process
listed; a worker's numbers move after requests (prefix cache hits after a repeated prompt, TTFT);
a SIGKILLed worker shows missing, then ready again with 1 restart; the table and --watch print;
the API's /metrics has the fleet gauges per worker; a stopped stack is one line and exit code 1
(with the targets file: each process missing, from its own probe)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import aiohttp
import openai
import pytest

from .conftest import UpProcess, moebus_up
from .test_launcher_faults import descendants, pid_of

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("torch")
# Longer than two KV blocks, so the second request finds the first one's blocks in the prefix cache.
PROMPT = [{"role": "user", "content": "In three sentences, explain why the sky is blue, what Rayleigh scattering "
                                      "is, and why sunsets look red and orange instead of blue."}]
SERVICES = {"frontend-0": "frontend", "tokenizer-0": "tokenizer", "balancer-0": "balancer",
            "kvbroker-0": "kvbroker", "worker-0": "worker", "worker-1": "worker"}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with moebus_up(tmp_path_factory.mktemp("up"), "--workers", "2") as up:
        yield up


def status(up: UpProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moebus.cli", "status", "--url", up.url, *args],
                          capture_output=True, text=True, timeout=60)


def instances(up: UpProcess) -> dict[str, dict]:
    out = status(up, "--json", "--targets", str(up.log_dir / "prometheus_targets.json"))
    assert out.returncode == 0, out.stderr
    return {r["instance_id"]: r for r in json.loads(out.stdout)["instances"]}


def until(up: UpProcess, predicate: Callable[[dict[str, dict]], bool], timeout: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while not predicate(rows := instances(up)):
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    return rows


async def test_status_lists_every_process_and_its_numbers_move(up: UpProcess) -> None:
    t0 = time.monotonic()
    rows = until(up, lambda rows: all(r["state"] == "ready" for r in rows.values()))
    assert {i: r["service"] for i, r in rows.items()} == SERVICES
    assert all(r["restarts"] == 0 for r in rows.values())
    client = openai.AsyncOpenAI(base_url=up.url, api_key="none", max_retries=0)
    for _ in range(3):
        await client.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=8, temperature=0)
    rows = until(up, lambda rows: any((rows[w]["prefix_cache_hit_rate"] or 0) > 0 for w in ("worker-0", "worker-1")))
    served = [r for r in rows.values() if r["service"] == "worker" and r["ttft_p50_s"] is not None]
    assert served and all(0 < r["ttft_p50_s"] <= r["ttft_p90_s"] and r["itl_p50_s"] > 0 for r in served)
    assert all(r["running"] == 0 and r["waiting"] == 0 and 0 <= r["kv_usage"] < 1 for r in served)

    table = status(up)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["INSTANCE", "SERVICE", "STATE"] and len(lines) == 1 + len(SERVICES)
    assert any(line.split()[:3] == ["worker-0", "worker", "ready"] for line in lines)

    async with aiohttp.ClientSession() as http, http.get(up.base_url + "/metrics") as r:
        text = await r.text()
    for gauge in ("prefix_cache_hit_rate", "kv_cache_usage_perc", "requests_running", "requests_waiting"):
        for worker in ("worker-0", "worker-1"):
            if gauge != "prefix_cache_hit_rate" or rows[worker]["prefix_cache_hit_rate"] is not None:
                assert f'moebus_frontend_fleet_{gauge}{{worker="{worker}"}}' in text, gauge
    print(f"\nstatus: every process ready, numbers moved, table printed in {time.monotonic() - t0:.1f}s")


def test_a_sigkilled_worker_is_missing_then_back_with_one_restart(up: UpProcess) -> None:
    t0 = time.monotonic()
    until(up, lambda rows: rows["worker-1"]["state"] == "ready")
    victim = pid_of(descendants(up.proc.pid), "--instance-id worker-1")
    subprocess.run(["kill", "-KILL", str(victim)], check=True)
    states = set()

    def back(rows: dict[str, dict]) -> bool:
        w = rows["worker-1"]
        states.add(w["state"])
        assert rows["worker-0"]["state"] == "ready"  # the other one is untouched
        return w["state"] == "ready" and w["restarts"] == 1

    rows = until(up, back)
    assert "missing" in states or "starting" in states, states  # seen down before it was back
    assert all(r["restarts"] == 0 for i, r in rows.items() if i != "worker-1")
    print(f"\nstatus: worker-1 SIGKILLed, seen {sorted(states)}, back with 1 restart in {time.monotonic() - t0:.1f}s")


def test_watch_refreshes_until_interrupted(up: UpProcess, tmp_path) -> None:
    out_path = tmp_path / "watch.out"
    with out_path.open("w") as out:  # a file, read while it runs: each refresh is flushed
        proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "status", "--url", up.url, "--watch", "0.2"],
                                stdout=out, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while out_path.read_text().count("INSTANCE") < 2:  # two refreshes
        assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out_path.read_text().count("INSTANCE") >= 2 and "Traceback" not in err


def test_a_stopped_stack_is_one_line_and_exit_code_1(up: UpProcess) -> None:
    up.proc.send_signal(signal.SIGTERM)  # the last test of the module: the stack goes
    up.proc.wait(60)
    out = status(up)
    assert out.returncode == 1 and out.stdout == "" and out.stderr.count("\n") == 1
    assert out.stderr.startswith("moebus status: cannot reach") and "Traceback" not in out.stderr
    out = status(up, "--json", "--targets", str(up.log_dir / "prometheus_targets.json"))  # each process's probe
    assert out.returncode == 1 and "readiness probe" in out.stderr and "Traceback" not in out.stderr
    assert {r["instance_id"]: r["state"] for r in json.loads(out.stdout)["instances"]} == \
        dict.fromkeys(SERVICES, "missing")
