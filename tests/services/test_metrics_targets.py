"""`moebus up` is scrapable from one place: every process serves /metrics, and the launcher lists
them all in a Prometheus file_sd targets file."""
from __future__ import annotations

import json

import aiohttp
import openai

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

from .test_dashboard import exported


async def test_every_process_is_a_target_and_serves_metrics(tmp_path) -> None:
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", heartbeat_interval_s=0.25,
                      log_dir=str(tmp_path), ready_timeout_s=120)
    with Stack(cfg) as stack:
        targets = json.loads((tmp_path / "prometheus_targets.json").read_text())
        assert targets == stack.metrics_targets()
        by_id = {t["labels"]["instance_id"]: t for t in targets}
        assert {i: t["labels"]["service"] for i, t in by_id.items()} == stack.services
        assert by_id["frontend-0"]["targets"] == [f"127.0.0.1:{cfg.port}"]  # its API port
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        names: dict[str, set[str]] = {}
        async with aiohttp.ClientSession() as http:
            for i, t in by_id.items():
                async with http.get(f"http://{t['targets'][0]}/metrics") as r:
                    assert r.status == 200, i
                    names[i] = exported(await r.text())
    assert "moebus:generation_tokens_total" in names["worker-0"]
    assert "moebus:time_to_first_token_seconds_bucket" in names["frontend-0"]
    assert "moebus_balancer_route_decisions_total" in names["balancer-0"]
    assert "moebus_tokenizer_renders_total" in names["tokenizer-0"]
