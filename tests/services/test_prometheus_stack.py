"""A real Prometheus (Debian's package; .ci/run installs it) scrapes `moebus up` on the real model
through the launcher's targets file, with the `moebus-local` job of deploy/prometheus/prometheus.yaml;
after some traffic, every query of the Grafana dashboard (deploy/grafana/moebus-dashboard.json),
evaluated as written through Prometheus' HTTP API, returns data. test_dashboard.py checks the
names; this checks that the series reach a Prometheus and that each expression has a result."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml  # (transformers' dependency)

from moebus.shared.nats_server import free_port

from .conftest import UpProcess, moebus_up, stop_process
from .test_dashboard import DEPLOY, expressions

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("torch")
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
RATE_WINDOW = "30s"  # $__rate_interval: the traffic below falls inside it when the queries run
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")  # Grafana's template function


def prometheus_config(targets: Path) -> dict:
    """deploy/prometheus/prometheus.yaml's moebus-local job on this stack's targets file, scraped each second
    (its moebus-pods job needs a Kubernetes API)."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yaml").read_text())
    [local] = [j for j in cfg["scrape_configs"] if j["job_name"] == "moebus-local"]
    local["file_sd_configs"][0].update(files=[str(targets)], refresh_interval="1s")
    return {**cfg, "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [local]}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    if not Path(PROMETHEUS).is_file():
        pytest.skip(f"no prometheus binary ({PROMETHEUS}): apt-get install prometheus (.ci/run does)")
    # an encoder too: the dashboard has its panel (smollm2 then takes ImageNet-classified images)
    with moebus_up(tmp_path_factory.mktemp("up"), "--workers", "1", "--encoders", "1") as up:
        yield up


@pytest.fixture(scope="module")
def prometheus(up: UpProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(json.dumps(prometheus_config(up.log_dir / "prometheus_targets.json")))
    port = free_port()  # not 9090: the package's own service may hold it
    with (tmp / "log").open("wb") as log:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 30)


async def api(http: aiohttp.ClientSession, url: str, path: str, **params: str) -> object:
    async with http.get(url + path, params=params) as r:
        body = await r.json()
    assert body["status"] == "success", body
    return body["data"]


async def until_targets_up(http: aiohttp.ClientSession, url: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            targets = (await api(http, url, "/api/v1/targets"))["activeTargets"]
            if len(targets) == n and all(t["health"] == "up" for t in targets):
                return
        except aiohttp.ClientError:  # not listening yet
            targets = []
        assert time.monotonic() < deadline, f"targets not all up: {targets}"
        await asyncio.sleep(0.25)


async def traffic(up: UpProcess) -> None:
    """Completions (streamed too: ITL), a prompt again (prefix cache), a 404 (the 4xx panel)."""
    client = openai.AsyncOpenAI(base_url=up.url, api_key="none", max_retries=0)
    prompt = [{"role": "user", "content": "Name three rivers of Europe and say which seas they flow into."}]
    for _ in range(3):
        await client.chat.completions.create(model="smollm2", messages=prompt, max_tokens=8, temperature=0)
    stream = await client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=16, stream=True)
    [c async for c in stream]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=prompt, max_tokens=4)


def promql(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", ".*")


async def test_every_dashboard_query_has_data(up: UpProcess, prometheus: str) -> None:
    t0 = time.monotonic()
    targets = json.loads((up.log_dir / "prometheus_targets.json").read_text())
    assert {t["labels"]["service"] for t in targets} >= {"frontend", "worker", "balancer", "tokenizer", "encoder"}
    async with aiohttp.ClientSession() as http:
        await until_targets_up(http, prometheus, len(targets))
        await traffic(up)
        exprs, empty = expressions(), {}
        deadline = time.monotonic() + 30  # a few scrapes after the traffic
        while True:
            empty = {}
            for expr in exprs:
                if m := LABEL_VALUES.match(expr):
                    got = await api(http, prometheus, f"/api/v1/label/{m[2]}/values", **{"match[]": m[1]})
                else:
                    got = (await api(http, prometheus, "/api/v1/query", query=promql(expr)))["result"]
                if not got:
                    empty[expr] = got
            if not empty or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert not empty, f"dashboard queries without data: {sorted(empty)}"
        fleet = (await api(http, prometheus, "/api/v1/query", query="moebus_frontend_fleet_requests_running"))["result"]
        assert [s["metric"]["worker"] for s in fleet] == ["worker-0"]  # the frontend's gauge, its label kept
        models = await api(http, prometheus, "/api/v1/label/model_name/values")
    assert "smollm2" in models
    print(f"\nprometheus: {len(exprs)} dashboard queries, each with data, {time.monotonic() - t0:.1f}s after ready")
