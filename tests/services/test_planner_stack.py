"""The planner end to end on the toy stack (real processes, `moebus up --autoscale`): a load ramp
makes it start workers, and once the load drops it drains them again without failing a request;
the launcher's autoscale wiring."""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import pytest
from nats.aio.msg import Msg
from openai import AsyncOpenAI

from moebus.services.cli import autoscale_bounds
from moebus.services.launcher import Stack, StackConfig
from moebus.services.planner.config import PlannerConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages.planner import PlannerDecision
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

FAST_PLANNER = {"interval_s": 0.5, "warmup_s": 1.0, "missed_heartbeats": 3,
                "policy": {"scale_out_cooldown_s": 1.0, "scale_in_cooldown_s": 1.0, "scale_in_stable_s": 1.5,
                           "lookahead_s": 1.0, "startup_grace_s": 20.0, "pools": {"both": {"target_inflight": 4}}}}


class LoadLoop:
    """`concurrency` streamed chat requests in flight, re-sent as they finish; every outcome kept."""

    def __init__(self, client: AsyncOpenAI, max_tokens: int = 30) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.concurrency = 0
        self.ok = 0
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task] = []

    def set(self, concurrency: int) -> None:
        self.concurrency = concurrency
        while len(self._tasks) < concurrency:
            self._tasks.append(asyncio.create_task(self._user(len(self._tasks))))

    async def _user(self, slot: int) -> None:
        while slot < self.concurrency:
            try:
                stream = await self.client.chat.completions.create(
                    model="toy", messages=[{"role": "user", "content": f"hello {slot}"}],
                    max_tokens=self.max_tokens, stream=True)
                tokens = 0
                async for chunk in stream:
                    tokens += sum(1 for c in chunk.choices if c.delta.content)
                    finish = [c.finish_reason for c in chunk.choices if c.finish_reason]
                assert finish == ["length"] and tokens > 0, (finish, tokens)
                self.ok += 1
            except Exception as e:  # counted, never raised: the test asserts there are none
                self.errors.append(repr(e))

    async def stop(self) -> None:
        self.concurrency = 0
        await asyncio.gather(*self._tasks)


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not in {timeout:g}s: {what}")
        await asyncio.sleep(0.1)


async def test_autoscale_scales_out_under_a_ramp_and_drains_back_in_without_failures(tmp_path) -> None:
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", heartbeat_interval_s=0.25,
                      engine={"step_delay_s": 0.02, "max_num_seqs": 4}, worker={"drain_grace_s": 10.0},
                      autoscale=(1, 3), planner=FAST_PLANNER, log_dir=str(tmp_path))
    with Stack(cfg) as stack:
        bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
        decisions: list[PlannerDecision] = []

        async def on_decision(d: PlannerDecision, _: Msg) -> None:
            decisions.append(d)

        await bus.subscribe(Subjects().planner_decision, PlannerDecision, on_decision)

        def pool() -> Any:
            return decisions[-1].pools[0] if decisions else None

        load = LoadLoop(AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0))
        try:
            await until(lambda: pool() is not None and pool().observed.replicas == 1, 10, "planner sees worker-0")
            for c in range(2, 14, 2):  # the ramp: 2 -> 12 streams over 3 s on one worker of 4 slots
                load.set(c)
                await asyncio.sleep(0.5)
            await until(lambda: pool().desired == 3 and pool().observed.replicas == 3, 20, "scaled out to 3")
            outs = [p for d in decisions for p in d.pools if p.action == "scale_out"]
            assert outs and all(p.desired <= 3 for p in outs)
            served_before = load.ok
            await until(lambda: load.ok > served_before, 10, "requests served after the scale-out")

            load.set(1)  # the load drops to one stream: scale-in by drain while requests still flow
            await until(lambda: pool().desired == 1 and pool().observed.replicas == 1
                        and pool().observed.draining == 0, 30, "drained back to 1")
            ins = [p for d in decisions for p in d.pools if p.action == "scale_in"]
            assert [(p.previous, p.desired) for p in ins] == [(3, 2), (2, 1)]
            await asyncio.sleep(1.0)  # the one worker left goes on serving: no error after the drain
        finally:
            await load.stop()
        assert not load.errors, load.errors[:5]
        assert load.ok >= 20
        stats = await bus.request(Subjects().stats("planner", "planner-0"), Empty(), Stats, timeout=2)
        actuator = stats.stats["actuator"]
        assert len(actuator["drained"]) + len(actuator["exits"]) >= 2
        assert all(code == 0 for code in actuator["exits"].values()), actuator  # drained workers exit 0
        assert stack.procs["worker-0"].poll() is None  # the launcher's own worker is kept (MIN)
        await bus.drain()


def test_autoscale_flag_and_stack_wiring() -> None:
    assert autoscale_bounds("2:5") == (2, 5)
    for bad in ("3", "0:2", "4:2", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            autoscale_bounds(bad)
    with pytest.raises(ValueError):
        StackConfig(autoscale=(3, 2))
    cfg = StackConfig(model="toy", nats_url="nats://x:4222", mode="disaggregated", prefill_workers=4,
                      autoscale=(2, 6), engine={"step_delay_s": 0.01},
                      planner={"interval_s": 2, "policy": {"pools": {"decode": {"max_replicas": 9}}}})
    configs = Stack(cfg).service_configs()
    workers = [c for s, c in configs if s == "worker"]
    assert sorted(w.instance_id for w in workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    (planner,) = [c for s, c in configs if s == "planner"]
    assert isinstance(planner, PlannerConfig) and planner.actuator == "local" and planner.interval_s == 2
    pools = planner.policy.pools
    assert (pools["prefill"].min_replicas, pools["prefill"].max_replicas) == (2, 6)
    assert (pools["decode"].min_replicas, pools["decode"].max_replicas) == (2, 9)  # --planner overrides merge
    assert planner.local.worker["model"] == "toy" and planner.local.worker["engine"] == {"step_delay_s": 0.01}
    plain = Stack(StackConfig(model="toy", nats_url="nats://x:4222", workers=2)).service_configs()
    assert [s for s, _ in plain].count("worker") == 2 and "planner" not in [s for s, _ in plain]
