"""Partitions between hosts (issue #40 item 2): three hosts (network namespaces), a NATS node on
each in one cluster with authenticated routes, every service started by `moebus serve` as an
operator would (services/host_stack.py). Host a: tokenizer, balancer, frontend, planner; host b:
a worker and the KV broker; host c: a worker. 20 toy streams run from a client on host a when
the network fails, for 5, 20 or 60 s, then heals:
- worker-host: b reaches nobody (its processes still reach its own node);
- frontend-host: a reaches nobody (the client is on a with the frontend);
- split-cluster: a and b cannot reach each other, c still reaches both (the route a-b is cut
  while every host reaches its own node).
Each time: every stream ends with the undisturbed (greedy) reply, no worker is declared lost and
nothing moves (a peer across a partition is waited for: shared/liveness.py), every request
finishes on exactly one worker, the planner keeps seeing both workers and decides nothing but
hold (no replacement, no drain), and the fleet is whole
again (full route mesh, every worker ready at the balancer) within WHOLE_S of the heal.
The default tier runs each kind for 5 s; `slow` runs 20 and 60 s. `-s` prints RELIABILITY.md's rows.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.balancer.config import BalancerConfig
from moebus.services.frontend.config import FrontendConfig
from moebus.services.host_stack import HostStack, Process
from moebus.services.kvbroker.config import KVBrokerConfig
from moebus.services.netns import available
from moebus.services.planner.config import PlannerConfig
from moebus.services.tokenizer.config import TokenizerConfig
from moebus.services.worker.config import WorkerConfig
from moebus.shared.bus import Bus
from moebus.shared.messages import PlannerDecision
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .test_bus_blips import STREAMS, Stream, run_stream

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")
pytestmark = [pytestmark, pytest.mark.slow]  # the slow tier: ./run test-slow

HB = {"heartbeat_interval_s": 0.2}
ENGINE = {"step_delay_s": 0.1, "max_num_seqs": STREAMS}
WORKERS = ("worker-b", "worker-c")
WHOLE_S = 5.0  # heal -> full route mesh and every worker ready at the balancer (measured: RELIABILITY.md)
AFTER_HEAL_S = 10.0  # heal -> every stream done, beyond its undisturbed end


def processes() -> list[Process]:
    worker = {"model": "toy", "engine": ENGINE, "max_queued": STREAMS, **HB}
    # two replicas, no more and no less: a worker it forgot would show as one replica (and be replaced)
    policy = {"pools": {"both": {"min_replicas": 2, "max_replicas": 2}}}
    return [Process("a", "tokenizer", TokenizerConfig(instance_id="tokenizer-a", model="toy", **HB)),
            # round robin: ten streams on each worker, so every cut holds some of them
            Process("a", "balancer", BalancerConfig(instance_id="balancer-a", policy="round_robin", **HB)),
            Process("a", "frontend", FrontendConfig(instance_id="frontend-a", port=8000, models=["toy"], **HB)),
            Process("a", "planner", PlannerConfig(instance_id="planner-a", interval_s=1, warmup_s=0, policy=policy,
                                                  **HB)),
            Process("b", "kvbroker", KVBrokerConfig(instance_id="kvbroker-b", **HB)),
            Process("b", "worker", WorkerConfig(instance_id="worker-b", **worker)),
            Process("c", "worker", WorkerConfig(instance_id="worker-c", **worker))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with HostStack(("a", "b", "c"), processes(), str(tmp_path_factory.mktemp("hosts"))) as s:
        yield s


FAULTS: dict[str, tuple[Callable[[HostStack], None], Callable[[HostStack], None]]] = {
    "worker-host": (lambda s: s.net.cut("b"), lambda s: s.net.heal("b")),
    "frontend-host": (lambda s: s.net.cut("a"), lambda s: s.net.heal("a")),
    "split-cluster": (lambda s: s.net.split("a", "b"), lambda s: s.net.unsplit("a", "b")),
}


@dataclass
class Outcome:
    kind: str
    seconds: float
    streams: list[Stream]
    healed_at: float
    whole_s: float  # heal -> fleet whole
    decisions: list[str]  # the planner's decisions that acted or saw a worker fewer, while it ran

    def resumes(self) -> list[float]:
        """Per stream unfinished at the heal: heal -> its next chunk."""
        return [t - self.healed_at for s in self.streams if (t := s.first_after(self.healed_at)) is not None]

    def row(self, lost: float, moved: float, finished: float) -> str:
        r = self.resumes() or [float("nan")]
        return (f"{self.kind} {self.seconds:g}s: {sum(s.text != TOY_REPLY for s in self.streams)} of "
                f"{len(self.streams)} streams lost, {lost:g} workers declared lost, {moved:g} moved, "
                f"{finished:g} finished; streams resumed after the heal p50 {statistics.median(r):.2f}s max "
                f"{max(r):.2f}s ({len(self.resumes())}); fleet whole {self.whole_s:.2f}s after the heal; "
                f"planner actions {self.decisions or 'none'}")


def counters(stack: HostStack) -> tuple[float, ...]:
    """(workers lost, migrations, requests aborted, then finished on each worker) so far."""
    return (stack.metric("balancer-a", "moebus_balancer_workers_lost_total"),
            stack.metric("frontend-a", "moebus_frontend_migrations_total"),
            sum(stack.metric(w, "moebus_worker_requests_total", 'outcome="aborted"') for w in WORKERS),
            *(stack.metric(w, "moebus_worker_requests_total", 'outcome="finished"') for w in WORKERS))


async def _whole(stack: HostStack, bus: Bus, since: float) -> float:
    """Seconds from `since` until every node routes to every other and the balancer routes to every
    worker again (ready, heard within two beats, not skipped)."""
    while True:
        routed = await asyncio.to_thread(lambda: all(stack.routes(h) == {"a", "b", "c"} - {h} for h in "abc"))
        if routed:
            stats = await bus.request(Subjects().stats("balancer", "balancer-a"), Empty(), Stats, timeout=2)
            if set(WORKERS) <= {w["worker_id"] for w in stats.stats["workers"]
                                if w["ready"] and not w["skipped"] and w["heard_s_ago"] < 2 * HB["heartbeat_interval_s"]}:
                return time.monotonic() - since
        await asyncio.sleep(0.05)


def partition(stack: HostStack, kind: str, seconds: float) -> Outcome:
    cut, heal = FAULTS[kind]

    async def run() -> Outcome:
        bus = await Bus.connect(stack.admin("partition-test", "a"), Tracing("test"))
        decisions: list[str] = []

        async def on_decision(d: PlannerDecision, _) -> None:
            decisions.extend(f"{p.pool}:{p.action} at {p.observed.replicas} replicas" for p in d.pools
                             if p.action != "hold" or p.observed.replicas != len(WORKERS))

        await bus.subscribe(Subjects().planner_decision, PlannerDecision, on_decision)
        client = openai.AsyncOpenAI(base_url=stack.frontend_url("frontend-a") + "/v1", api_key="none",
                                    max_retries=0, timeout=seconds + 90)
        streams = [Stream() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(run_stream(client, s)) for s in streams]
        try:
            while not all(len(s.times) >= 3 for s in streams):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.02)
            await asyncio.to_thread(cut, stack)
            await asyncio.sleep(seconds)  # the partition holds
            await asyncio.to_thread(heal, stack)
            healed_at = time.monotonic()
            whole_s = await asyncio.wait_for(_whole(stack, bus, healed_at), 60)
            await asyncio.wait_for(asyncio.gather(*tasks), AFTER_HEAL_S + 10)
        finally:
            for t in tasks:
                t.cancel()
            await client.close()
            await bus.drain()
        return Outcome(kind, seconds, streams, healed_at, whole_s, decisions)

    return stack.run_async("a", run)


def check(stack: HostStack, kind: str, seconds: float) -> None:
    before = counters(stack)
    try:
        out = partition(stack, kind, seconds)
    finally:  # the next case starts from a whole network whatever happened
        stack.net.heal_all()
    lost, moved, aborted, *finished = (a - b for a, b in zip(counters(stack), before, strict=True))
    print("\n" + out.row(lost, moved, sum(finished)))
    assert [s.text for s in out.streams] == [TOY_REPLY] * STREAMS
    assert lost == 0 and moved == 0 and aborted == 0
    assert finished == [STREAMS / 2] * 2  # each request ran to its end once, on the worker it was sent to
    assert out.decisions == []
    assert out.whole_s < WHOLE_S
    assert max(s.ended for s in out.streams) - out.healed_at < AFTER_HEAL_S


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_5s_partition_loses_nothing(stack: HostStack, kind: str) -> None:
    check(stack, kind, 5)


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [20, 60])
@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_long_partition_loses_nothing(stack: HostStack, kind: str, seconds: float) -> None:
    check(stack, kind, seconds)
