"""The vLLM-shaped `moebus:*` metrics: names, types and label sets after requests through the toy stack."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from moebus.devmodel.toy import TOY_REPLY

from .conftest import ToyStack

CHAT = [{"role": "user", "content": "hi"}]


def samples(text: str) -> dict[str, list]:
    """Sample name -> its samples (name, labels, value)."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def scrape_frontend(stack: ToyStack) -> str:
    async with aiohttp.ClientSession() as http, http.get(stack.base_url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def drive(stack: ToyStack) -> None:
    client = stack.client()
    await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200)
    await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=5)
    stream = await client.completions.create(model="toy", prompt="hello", max_tokens=8, stream=True)
    [c async for c in stream]
    await stack.wait_idle()


async def test_worker_exports_vllm_names(stack: ToyStack) -> None:
    await drive(stack)
    w = stack.workers[0]
    got = samples(w.metrics.render().decode())
    labels = {"model_name": "toy", "engine": w.instance_id}
    for name in ("moebus:num_requests_running", "moebus:num_requests_waiting", "moebus:kv_cache_usage_perc",
                 "moebus:prefix_cache_hits_total", "moebus:prefix_cache_queries_total",
                 "moebus:prompt_tokens_total", "moebus:generation_tokens_total"):
        assert [s.labels for s in got[name]] == [labels], name
    value = {n: got[n][0].value for n in got if n.startswith("moebus:") and len(got[n]) == 1}
    assert value["moebus:num_requests_running"] == 0 and value["moebus:num_requests_waiting"] == 0
    assert value["moebus:kv_cache_usage_perc"] == 0  # idle: every block free
    assert value["moebus:generation_tokens_total"] == len(TOY_REPLY.encode()) + 1 + 5 + 8  # bytes + EOS, 5, 8
    assert value["moebus:prompt_tokens_total"] > 0
    assert value["moebus:prefix_cache_queries_total"] == value["moebus:prompt_tokens_total"]
    assert 0 <= value["moebus:prefix_cache_hits_total"] <= value["moebus:prefix_cache_queries_total"]
    success = {s.labels["finished_reason"]: s.value for s in got["moebus:request_success_total"]}
    assert success == {"stop": 1, "length": 2}
    assert all(set(s.labels) == {*labels, "finished_reason"} for s in got["moebus:request_success_total"])
    # the old names stay
    assert "moebus_worker_requests_total" in got and "moebus_worker_generated_tokens_total" in got


async def test_frontend_exports_client_latencies(stack: ToyStack) -> None:
    await drive(stack)
    got = samples(await scrape_frontend(stack))
    for name in ("moebus:time_to_first_token_seconds", "moebus:inter_token_latency_seconds",
                 "moebus:e2e_request_latency_seconds"):
        count = got[name + "_count"]
        assert [s.labels for s in count] == [{"model_name": "toy"}], name
        assert all(set(s.labels) == {"model_name", "le"} for s in got[name + "_bucket"])
    assert got["moebus:time_to_first_token_seconds_count"][0].value == 3
    assert got["moebus:e2e_request_latency_seconds_count"][0].value == 3
    assert got["moebus:inter_token_latency_seconds_count"][0].value > 0
    assert "moebus_frontend_time_to_first_token_seconds_count" in got  # the old name stays


async def test_balancer_counts_route_decisions(stack: ToyStack) -> None:
    await drive(stack)
    got = samples(stack.balancer.metrics.render().decode())
    reasons = {s.labels["reason"]: s.value for s in got["moebus_balancer_route_decisions_total"]}
    assert reasons["load_only"] == 3  # toy workers carry no KV info
