"""The balancer's routing decisions by reason (moebus_balancer_route_decisions_total{reason})."""
from __future__ import annotations

from types import SimpleNamespace

from moebus.services.balancer.kv_rank import REASONS, KVRanker
from moebus.services.balancer.table import WorkerTable
from moebus.shared.messages import Heartbeat, KVInfo, Load
from moebus.shared.messages.kvbroker import PrefixMatch
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


async def test_each_route_is_counted_by_reason() -> None:
    m = Metrics("balancer")
    ranker = KVRanker(SimpleNamespace(metrics=m), None, backoff_s=0.0)  # type: ignore[arg-type]
    answers = [[PrefixMatch(holder="w1", tier="device", num_blocks=2)], [], None]

    async def query(hashes, holders):
        return answers.pop(0)
    ranker.index.query = query
    prompt = [1, 2, 3, 4, 5]
    await ranker.order(prompt, entries(kv=False))  # toy workers: no KV info
    await ranker.order(prompt, entries(kv=True, n=1))  # one candidate: nothing to rank
    assert [e.worker_id for e in (await ranker.order(prompt, entries(kv=True))).entries][0] == "w1"  # prefix_hit
    await ranker.order(prompt, entries(kv=True))  # the index knows none
    await ranker.order(prompt, entries(kv=True))  # the broker did not answer
    await ranker.order([1], entries(kv=True))  # shorter than a block: nothing to ask
    assert decisions(m) == {"load_only": 2, "prefix_hit": 1, "no_prefix": 2, "index_unavailable": 1}
    assert set(decisions(m)) == set(REASONS)


async def test_a_follow_up_stays_on_its_cache_before_the_next_heartbeat() -> None:
    """A follow-up picked for the worker holding its prefix counts there as the few tokens it
    computes, not as a whole waiting request, until the worker's next heartbeat: the next
    follow-up (sent before that beat) still goes to the cache. An unrelated burst still spreads."""
    ranker = KVRanker(SimpleNamespace(metrics=None), None, backoff_s=0.0)  # type: ignore[arg-type]
    prompt = list(range(200))  # 100 blocks of 2; w0 holds 95 of them

    async def query(hashes, holders):
        return [PrefixMatch(holder="w0", tier="device", num_blocks=95)] if hashes[0] == hashes_of[0] else []
    hashes_of = [None]
    ranker.index.query = query
    table = WorkerTable()
    for i in range(2):
        table.observe(Heartbeat(service="worker", instance_id=f"w{i}", ts=0, interval_s=1.0, ready=True, model="m",
                                load=Load(max_waiting=8, kv_blocks_free=500, kv_blocks_total=500),
                                kv=KVInfo(namespace="n", block_size=2)), 0.0)
    from moebus.kv.hashing import stable_block_hashes

    hashes_of[0] = stable_block_hashes(prompt, 2, "n")[0]
    for _ in range(3):
        ranking = await ranker.order(prompt, table.candidates("m", 0.0))
        assert ranking.entries[0].worker_id == "w0"
        assert ranking.prefill_tokens == {"w0": 10.0, "w1": 200.0}
        table.assigned("w0", tokens=ranking.prefill_tokens["w0"])  # no heartbeat in between
    assert table.get("w0").pending == 3 and table.get("w0").pending_tokens == 30.0
    picks = []
    for i in range(4):
        ranking = await ranker.order([1000 + i] * 64, table.candidates("m", 0.0))
        picks.append(ranking.entries[0].worker_id)
        table.assigned(picks[-1], tokens=ranking.prefill_tokens[picks[-1]])
    assert sorted(picks) == ["w0", "w0", "w1", "w1"]
