"""Tenants and admission without a bus: the fair queue, rate buckets, token budgets, the keys file."""
from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import pytest
from pydantic import ValidationError

from moebus.services.frontend.admission.admission import Admission, Rejected, TokenBucket
from moebus.services.frontend.admission.fair_queue import FairQueue
from moebus.services.frontend.admission.tenants import DEFAULT, KeyRing, KeysFile, Tenant, add_key, hash_key
from moebus.services.frontend.config import AdmissionConfig, FrontendConfig, TenantLimits
from moebus.shared.metrics import Metrics


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _backlog(q: FairQueue, flows: list[tuple[str, int, float]], order: list[str]) -> list[asyncio.Task]:
    """Queue one acquire per (flow, tokens, weight), in this order; each appends its flow on start."""
    async def one(flow: str, tokens: int, weight: float) -> None:
        await q.acquire(flow, tokens, weight)
        order.append(flow)

    tasks = []
    for f in flows:
        tasks.append(asyncio.create_task(one(*f)))
        await _settle()
    return tasks


async def _drain(q: FairQueue, order: list[str], count: int, tokens: int = 10) -> None:
    """Release `count` runs one at a time (each release starts the next waiter)."""
    for _ in range(count):
        q.release(tokens)
        await _settle()


async def test_idle_flow_goes_ahead_of_a_backlog() -> None:
    q, order = FairQueue(max_running=2, max_tokens=None), []
    await _backlog(q, [("a", 10, 1.0)] * 8, order)
    assert order == ["a", "a"] and q.waiting == 6
    await _backlog(q, [("b", 10, 1.0)], order)
    await _drain(q, order, 1)
    assert order[-1] == "b", "b waits for one free place only, not for a's backlog"
    await _drain(q, order, 6)
    assert order.count("a") == 8 and q.waiting == 0


async def test_first_come_baseline_serves_the_backlog_first() -> None:
    q, order = FairQueue(max_running=2, max_tokens=None, fair=False), []
    await _backlog(q, [("a", 10, 1.0)] * 8 + [("b", 10, 1.0)], order)
    await _drain(q, order, 7)
    assert order == ["a"] * 8 + ["b"]


async def test_backlogged_flows_share_tokens_by_weight() -> None:
    q, order = FairQueue(max_running=1, max_tokens=None), []
    await _backlog(q, [("a", 10, 2.0), ("b", 10, 1.0)] * 40, order)
    await _drain(q, order, 60)
    got = Counter(order[:60])
    assert abs(got["a"] - 40) <= 2 and abs(got["b"] - 20) <= 2, got


async def test_shares_count_tokens_not_requests() -> None:
    q, order = FairQueue(max_running=1, max_tokens=None), []
    await _backlog(q, [("big", 100, 1.0)] * 5 + [("small", 10, 1.0)] * 50, order)
    await _drain(q, order, 30)
    got = Counter(order[1:31])  # after the first (it started at once)
    assert got["small"] >= 25, got  # ~10 small per big: equal tokens


async def test_past_use_alone_banks_no_debt() -> None:
    q, order = FairQueue(max_running=1, max_tokens=None), []
    for _ in range(100):  # a ran alone for a long time
        await q.acquire("a", 10)
        q.release(10)
    await _backlog(q, [("a", 10, 1.0), ("b", 10, 1.0)] * 5, order)
    await _drain(q, order, 9)
    assert order[:4] in (["a", "b", "a", "b"], ["a", "a", "b", "a"]), order  # a is not shut out by its past
    assert Counter(order) == {"a": 5, "b": 5}


async def test_token_capacity_and_a_large_head() -> None:
    q, order = FairQueue(max_running=None, max_tokens=100), []
    await _backlog(q, [("a", 60, 1.0), ("a", 60, 1.0), ("a", 10, 1.0)], order)
    assert order == ["a"], "the second does not fit beside the first; the small third waits behind it"
    q.release(60)
    await _settle()
    assert order == ["a", "a", "a"] and q.running_tokens == 70
    q.release(60)
    q.release(10)
    await _backlog(q, [("b", 500, 1.0)], order)
    assert order[-1] == "b" and q.running == 1, "larger than the whole capacity: runs alone"


async def test_a_waiter_that_gives_up_leaves_no_trace() -> None:
    q = FairQueue(max_running=1, max_tokens=None)
    await q.acquire("a", 10)
    with pytest.raises(TimeoutError):
        await q.acquire("b", 10, timeout=0.05)
    assert q.waiting == 0 and q.running == 1
    waiter = asyncio.create_task(q.acquire("b", 10))
    await _settle()
    waiter.cancel()
    await _settle()
    assert q.waiting == 0
    q.release(10)
    assert q.running == 0 and q.running_tokens == 0
    await asyncio.wait_for(q.acquire("c", 10), 1)  # nothing stale in front of it


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0, 0, 0]
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0 and b.take(0.5) == pytest.approx(0.5)
    assert b.take(100.0) == 0 and b._level == 2  # refills to the burst, no further


def _admission(**cfg) -> tuple[Admission, Metrics]:
    m = Metrics("frontend")
    return Admission(AdmissionConfig(**cfg), m), m


def _metric(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(f"moebus_frontend_{name}", labels)


async def test_budget_is_held_and_refunded_on_every_exit() -> None:
    adm, m = _admission()
    acme = Tenant("acme", TenantLimits(max_tokens_in_flight=100))
    async with adm.admit(acme, 60):
        assert adm.tokens_in_flight("acme") == 60
        with pytest.raises(Rejected) as e:
            async with adm.admit(acme, 50):
                pass
        assert e.value.status == 429 and e.value.reason == "budget" and e.value.retry_after
        async with adm.admit(acme, 40):
            assert _metric(m, "tenant_tokens_in_flight", tenant="acme") == 100
    assert adm.tokens_in_flight("acme") == 0
    with pytest.raises(RuntimeError):
        async with adm.admit(acme, 60):
            raise RuntimeError("the worker failed")
    assert adm.tokens_in_flight("acme") == 0
    with pytest.raises(Rejected) as e:
        async with adm.admit(acme, 101):
            pass
    assert e.value.status == 400 and e.value.reason == "too_large"
    assert _metric(m, "tenant_rejected_total", tenant="acme", reason="budget") == 1
    assert _metric(m, "tenant_admitted_total", tenant="acme") == 3
    assert _metric(m, "tenant_tokens_in_flight", tenant="acme") == 0


async def test_waiting_for_capacity_holds_budget_and_gives_up_with_429() -> None:
    adm, m = _admission(max_running=1, max_wait_s=0.05)
    a, b = Tenant("a", TenantLimits()), Tenant("b", TenantLimits())
    async with adm.admit(a, 10):
        with pytest.raises(Rejected) as e:
            async with adm.admit(b, 20):
                pass
        assert e.value.reason == "wait" and e.value.status == 429
        assert adm.tokens_in_flight("b") == 0
        started = asyncio.Event()

        async def client() -> None:  # goes away while waiting: handler cancellation
            async with adm.admit(b, 20):
                started.set()

        task = asyncio.create_task(client())
        await _settle()
        assert adm.tokens_in_flight("b") == 20 and _metric(m, "tenant_waiting_requests", tenant="b") == 1
        task.cancel()
        await _settle()
    assert adm.tokens_in_flight("b") == 0 and adm.queue.running == 0 and not started.is_set()
    assert _metric(m, "tenant_waiting_requests", tenant="b") == 0
    assert _metric(m, "tenant_rejected_total", tenant="b", reason="wait") == 1
    assert _metric(m, "tenant_queue_wait_seconds_count", tenant="a") == 1


def test_rate_limit_per_tenant() -> None:
    now = [0.0]
    adm = Admission(AdmissionConfig(), Metrics("frontend"), clock=lambda: now[0])
    slow, free = Tenant("slow", TenantLimits(rate=1.0, burst=2)), Tenant("free", TenantLimits())
    adm.check_rate(slow)
    adm.check_rate(slow)
    with pytest.raises(Rejected) as e:
        adm.check_rate(slow)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded" and e.value.retry_after == 1.0
    assert e.value.response().headers["Retry-After"] == "1"
    for _ in range(100):
        adm.check_rate(free)
    now[0] = 1.0
    adm.check_rate(slow)


def _keys_file(tmp_path, data: dict) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_keys_file_maps_hashed_keys_to_tenants(tmp_path) -> None:
    path = _keys_file(tmp_path, {"tenants": {"acme": {"weight": 3, "priority": -1}, "beta": {}},
                                 "keys": [{"sha256": hash_key("k-acme"), "tenant": "acme"},
                                          {"sha256": hash_key("k-beta"), "tenant": "beta", "label": "ci"}]})
    ring = KeyRing.from_config(FrontendConfig(keys_file=path, api_keys=["legacy"]))
    assert ring.tenant("k-acme").name == "acme" and ring.tenant("k-acme").limits.weight == 3
    assert ring.tenant("k-beta").name == "beta"
    assert ring.tenant("legacy").name == DEFAULT
    assert ring.tenant("k-acme ") is None and ring.tenant("") is None and ring.tenant(hash_key("k-acme")) is None
    assert "k-acme" not in open(path).read()


def test_flat_api_keys_are_one_default_tenant() -> None:
    cfg = FrontendConfig(api_keys=["sk-1", "sk-2"], admission={"default_tenant": {"rate": 3}})
    ring = KeyRing.from_config(cfg)
    assert ring.tenant("sk-2").name == DEFAULT and ring.tenant("sk-2").limits.rate == 3
    assert ring.tenant("sk-3") is None
    open_ring = KeyRing.from_config(FrontendConfig())
    assert not open_ring.required and open_ring.tenant("anything").name == DEFAULT


@pytest.mark.parametrize("data", [
    {"keys": [{"sha256": "ab" * 32, "tenant": "nobody"}]},
    {"keys": [{"sha256": "not-hex", "tenant": DEFAULT}]},
    {"keys": [{"sha256": "ab" * 32, "tenant": DEFAULT}] * 2},
    {"keys": [{"key": "plain", "tenant": DEFAULT}]},
    {"tenants": {"a": {"weight": 0}}},
])
def test_bad_keys_files_are_refused(tmp_path, data) -> None:
    with pytest.raises(ValidationError):
        KeyRing.from_config(FrontendConfig(keys_file=_keys_file(tmp_path, data)))


def test_add_key_prints_once_and_stores_the_hash(tmp_path) -> None:
    path = tmp_path / "keys.json"
    k1 = add_key(path, "acme", TenantLimits(rate=2, max_tokens_in_flight=1000), label="ci")
    k2 = add_key(path, "acme")
    k3 = add_key(path, DEFAULT)
    assert len({k1, k2, k3}) == 3 and all(k.startswith("mb-") and len(k) > 40 for k in (k1, k2, k3))
    text = path.read_text()
    assert k1 not in text and hash_key(k1) in text
    assert os.stat(path).st_mode & 0o777 == 0o600
    keys = KeysFile.load(path)
    assert keys.tenants["acme"].rate == 2 and DEFAULT not in keys.tenants  # the config's default limits apply
    ring = KeyRing.from_config(FrontendConfig(keys_file=str(path)))
    assert ring.tenant(k1).name == ring.tenant(k2).name == "acme" and ring.tenant(k3).name == DEFAULT
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]  # no temp file left
