"""deploy/grafana/moebus-dashboard.json: every metric its PromQL names is exported by some service
(the toy stack after a few requests, plus the registries of an encoder and a real
worker's KV link); deploy/prometheus/prometheus.yaml parses."""
from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moebus.services.encoder import EncoderConfig, EncoderService
from moebus.shared.metrics import Metrics

from .conftest import ToyStack

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("_count", "_sum")}
NAME = re.compile(r"(?<![\w:\"])(moebus[_:][A-Za-z0-9_:]+)")
NAME_REGEX = re.compile(r'__name__=~"([^"]+)"')


def exported(text: str) -> set[str]:
    """Every series name a scrape can hold: declared families with their type's suffixes (a
    labelled metric nobody used yet has no samples, but its name is exported)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


def expressions() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "moebus-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def kv_link_metrics() -> str:
    """A real-engine worker's KV link registers its metrics (toy workers have none)."""
    from moebus.services.worker.config import WorkerConfig
    from moebus.services.worker.kv_link import WorkerKVLink  # torch behind this import

    m = Metrics("worker")
    WorkerKVLink(WorkerConfig(model="toy"), None, "w0", None, None, metrics=m)  # type: ignore[arg-type]
    return m.render().decode()


def test_dashboard_names_parse_out() -> None:
    names = {n for e in expressions() for n in NAME.findall(e)}
    assert "moebus:time_to_first_token_seconds_bucket" in names and "moebus:kv_cache_usage_perc" in names
    assert all(not n.endswith(("_", ":")) for n in names)


async def test_every_dashboard_metric_is_exported(stack: ToyStack) -> None:
    client = stack.client()
    await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    stream = await client.completions.create(model="toy", prompt="hello", max_tokens=8, stream=True)
    [c async for c in stream]
    await client.models.list()
    await stack.wait_idle()
    async with aiohttp.ClientSession() as http, http.get(stack.base_url + "/metrics") as r:
        texts = [await r.text()]
    texts += [s.metrics.render().decode() for s in (stack.tokenizer, stack.balancer, *stack.workers)]
    texts.append(EncoderService(EncoderConfig()).metrics.render().decode())  # not in the toy stack
    texts.append(kv_link_metrics())
    names = set().union(*map(exported, texts))
    missing = {n for e in expressions() for n in NAME.findall(e)} - names
    assert not missing, f"the dashboard uses metrics no service exports: {sorted(missing)}"
    for e in expressions():
        for rx in NAME_REGEX.findall(e):
            assert any(re.fullmatch(rx, n) for n in names), rx


def test_prometheus_config_parses() -> None:
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yaml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"moebus-pods", "moebus-local"}
    assert jobs["moebus-local"]["file_sd_configs"][0]["files"][0].endswith("prometheus_targets.json")
