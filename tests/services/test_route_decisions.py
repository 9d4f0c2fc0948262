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
    assert [e.worker_id for e in await ranker.order(prompt, entries(kv=True))][0] == "w1"  # prefix_hit
    await ranker.order(prompt, entries(kv=True))  # the index knows none
    await ranker.order(prompt, entries(kv=True))  # the broker did not answer
    await ranker.order([1], entries(kv=True))  # shorter than a block: nothing to ask
    assert decisions(m) == {"load_only": 2, "prefix_hit": 1, "no_prefix": 2, "index_unavailable": 1}
    assert set(decisions(m)) == set(REASONS)
