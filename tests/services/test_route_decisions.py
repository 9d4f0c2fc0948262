"""The balancer's routing decisions by reason (moebus_balancer_route_decisions_total{reason})."""
from __future__ import annotations

from moebus.kv.hashing import hash_space, stable_block_hashes
from moebus.kv.index import PrefixIndex
from moebus.services.balancer.kv_rank import REASONS, KVRanker
from moebus.services.balancer.table import WorkerTable
from moebus.shared.messages import (
    BROKER_HOLDER,
    GenerateRequest,
    Heartbeat,
    KVEvent,
    KVInfo,
    Load,
    SamplingOptions,
)
from moebus.shared.metrics import Metrics


def entries(kv: bool, n: int = 2) -> list:
    table = WorkerTable()
    for i in range(n):
        table.observe(Heartbeat(service="worker", instance_id=f"w{i}", ts=0, interval_s=1.0, ready=True, model="m",
                                load=Load(num_running=0, num_waiting=0, max_waiting=8, kv_blocks_free=10,
                                          kv_blocks_total=10),
                                kv=KVInfo(namespace="n", block_size=2) if kv else None), 0.0)
    return table.candidates("m", 0.0)


def decisions(m: Metrics) -> dict[str, float]:
    return {s.labels["reason"]: s.value for fam in m.registry.collect() for s in fam.samples
            if s.name == "moebus_balancer_route_decisions_total"}


def req(prompt: list[int], carried: list[int] | None = None, space: str = "") -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", prompt_token_ids=prompt, params=SamplingOptions(),
                           reply_to="x", block_hashes=carried or [], block_hash_space=space)


def test_each_route_is_counted_by_reason() -> None:
    m = Metrics("balancer")
    index = PrefixIndex()
    ranker = KVRanker(index, m)
    prompt = [1, 2, 3, 4, 5]
    ranker.order(req(prompt), entries(kv=False))  # toy workers: no KV info
    ranker.order(req(prompt), entries(kv=True, n=1))  # one candidate: nothing to rank
    ranker.order(req(prompt), entries(kv=True))  # no candidate has reported its cache yet
    hashes = stable_block_hashes(prompt, 2, "n")
    index.apply(KVEvent(holder="w1", stored=hashes), 0.0)
    assert [e.worker_id for e in ranker.order(req(prompt), entries(kv=True)).entries][0] == "w1"  # prefix_hit
    ranker.order(req([9, 9, 9]), entries(kv=True))  # the index knows none
    ranker.order(req([1]), entries(kv=True))  # shorter than a block: nothing to look up
    assert decisions(m) == {"load_only": 2, "prefix_hit": 1, "no_prefix": 2, "index_unavailable": 1}
    assert set(decisions(m)) == set(REASONS)


def test_the_requests_own_hashes_are_used_when_hashed_for_these_workers() -> None:
    """The frontend hashes a prompt once: the balancer ranks by those hashes when they are in its
    workers' space (here deliberately the hashes of another prompt, so using them shows), and
    hashes the prompt itself when they are not."""
    index = PrefixIndex()
    ranker = KVRanker(index)
    prompt, other = [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]
    index.apply(KVEvent(holder="w1", stored=stable_block_hashes(other, 2, "n")), 0.0)
    carried = stable_block_hashes(other, 2, "n")
    assert ranker.order(req(prompt, carried, hash_space("n", 2)), entries(kv=True)).prefill_tokens == \
        {"w0": 5.0, "w1": 1.0}
    assert ranker.order(req(prompt, carried, hash_space("n", 4)), entries(kv=True)).prefill_tokens == \
        {"w0": 5.0, "w1": 5.0}
    assert req(prompt, carried, hash_space("n", 4)).block_hashes_in(2, "n") == stable_block_hashes(prompt, 2, "n")


def test_the_brokers_tiers_count_for_every_worker() -> None:
    """Blocks the broker's tiers hold (its own KV events) are loadable by any worker."""
    index = PrefixIndex()
    ranker = KVRanker(index)
    prompt = list(range(10))
    index.apply(KVEvent(holder=BROKER_HOLDER, tier="cpu", stored=stable_block_hashes(prompt, 2, "n")[:3]), 0.0)
    assert ranker.order(req(prompt), entries(kv=True)).prefill_tokens == {"w0": 4.0, "w1": 4.0}


def test_a_follow_up_stays_on_its_cache_before_the_next_heartbeat() -> None:
    """A follow-up picked for the worker holding its prefix counts there as the few tokens it
    computes, not as a whole waiting request, until the worker's next heartbeat: the next
    follow-up (sent before that beat) still goes to the cache. An unrelated burst still spreads."""
    index = PrefixIndex()
    ranker = KVRanker(index)
    prompt = list(range(200))  # 100 blocks of 2; w0 holds 95 of them
    index.apply(KVEvent(holder="w0", stored=stable_block_hashes(prompt, 2, "n")[:95]), 0.0)
    index.apply(KVEvent(holder="w1", stored=[]), 0.0)
    table = WorkerTable()
    for i in range(2):
        table.observe(Heartbeat(service="worker", instance_id=f"w{i}", ts=0, interval_s=1.0, ready=True, model="m",
                                load=Load(max_waiting=8, kv_blocks_free=500, kv_blocks_total=500),
                                kv=KVInfo(namespace="n", block_size=2)), 0.0)
    for _ in range(3):
        ranking = ranker.order(req(prompt), table.candidates("m", 0.0))
        assert ranking.entries[0].worker_id == "w0"
        assert ranking.prefill_tokens == {"w0": 10.0, "w1": 200.0}
        table.assigned("w0", tokens=ranking.prefill_tokens["w0"])  # no heartbeat in between
    assert table.get("w0").pending == 3 and table.get("w0").pending_tokens == 30.0
    picks = []
    for i in range(4):
        ranking = ranker.order(req([1000 + i] * 64), table.candidates("m", 0.0))
        picks.append(ranking.entries[0].worker_id)
        table.assigned(picks[-1], tokens=ranking.prefill_tokens[picks[-1]])
    assert sorted(picks) == ["w0", "w0", "w1", "w1"]
