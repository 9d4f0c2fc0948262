"""The planner service over a real nats-server with made-up worker heartbeats: decisions are
published and exported as metrics; the local actuator's choice of what to start, stop and drain."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from moebus.services.planner import PlannerConfig, PlannerService
from moebus.services.planner.actuator import Actuator, NoActuator
from moebus.services.planner.config import LocalActuatorConfig
from moebus.services.planner.fleet import WorkerView
from moebus.services.planner.kube import KubernetesActuator
from moebus.services.planner.local import LocalActuator
from moebus.shared.messages import Heartbeat, Load
from moebus.shared.messages.planner import PlannerDecision
from moebus.shared.nats_server import NatsServer

from .conftest import wait_for


async def test_decisions_are_published_and_exported(nats_server: NatsServer) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    cfg = PlannerConfig(nats_url=nats_server.url, subject_prefix=prefix, interval_s=0.1, warmup_s=0,
                        heartbeat_interval_s=0.1,
                        policy={"scale_out_cooldown_s": 0, "pools": {"both": {"max_replicas": 3, "target_inflight": 4}}})
    async with PlannerService(cfg) as planner:
        assert isinstance(planner.actuator, NoActuator) and isinstance(planner.actuator, Actuator)
        seen: list[PlannerDecision] = []

        async def on_decision(d: PlannerDecision, _: Msg) -> None:
            seen.append(d)

        await planner.bus.subscribe(planner.subjects.planner_decision, PlannerDecision, on_decision)
        beat = Heartbeat(service="worker", instance_id="w-0", ts=time.time(), interval_s=0.1, role="both",
                         load=Load(num_running=4, num_waiting=8, ttft_p90_s=3.0))
        for _ in range(5):
            beat.ts = time.time()
            await planner.bus.publish(planner.subjects.heartbeat("worker", "w-0"), beat)
            await asyncio.sleep(0.1)  # beats at the worker's interval
        await wait_for(lambda: any(p.action == "scale_out" for d in seen for p in d.pools))
        d = next(p for d in seen for p in d.pools if p.action == "scale_out")
        assert d.pool == "both" and d.observed.replicas == 1 and d.slo_violated and "ttft" in d.reason
        assert planner.actuator.asked["both"] >= 2
        metrics = planner.metrics.render().decode()
        assert 'moebus_planner_desired_replicas{pool="both"}' in metrics
        assert 'moebus_planner_scale_actions_total{action="scale_out",pool="both"}' in metrics
        assert 'moebus_planner_ttft_p90_seconds{pool="both"} 3.0' in metrics
        assert planner.stats()["last"]["pools"][0]["pool"] == "both"


async def test_the_first_decision_waits_for_the_min_workers_to_show_up(nats_server: NatsServer) -> None:
    """A real-model worker started with the planner beats only after ~15 s of loading: the planner
    must not take the empty pool for one below min_replicas and start a duplicate."""
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    cfg = PlannerConfig(nats_url=nats_server.url, subject_prefix=prefix, interval_s=0.05, warmup_s=0,
                        heartbeat_interval_s=0.1, policy={"startup_grace_s": 30, "pools": {"both": {}}})
    async with PlannerService(cfg) as planner:
        await asyncio.sleep(0.5)  # the worker is still loading
        assert planner.decisions == 0
        beat = Heartbeat(service="worker", instance_id="w-0", ts=time.time(), interval_s=0.1, role="both",
                         ready=False, load=Load())
        await planner.bus.publish(planner.subjects.heartbeat("worker", "w-0"), beat)
        await wait_for(lambda: planner.decisions > 0)
        assert planner.last.pools[0].action == "hold" and planner.actuator.asked.get("both", 1) == 1


@dataclass
class FakeProc:
    pid: int = 0
    terminated: bool = False

    def poll(self) -> int | None:
        return None

    def terminate(self) -> None:
        self.terminated = True


@dataclass
class FakeBus:
    requests: list[str] = field(default_factory=list)

    async def request(self, subject: str, *_: Any, **__: Any) -> None:
        self.requests.append(subject)


def local_actuator(monkeypatch) -> tuple[LocalActuator, FakeBus]:
    from moebus.services.planner import local
    from moebus.shared.subjects import Subjects

    bus = FakeBus()
    act = LocalActuator(LocalActuatorConfig(worker={"model": "toy"}), bus, Subjects(), {"nats_url": "nats://x"})
    started: list[list[str]] = []

    def popen(cmd: list[str], **_: Any) -> FakeProc:
        started.append(cmd)
        return FakeProc(pid=len(started))

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    act.started = started  # type: ignore[attr-defined]
    return act, bus


def view(wid: str, inflight: int = 0, draining: bool = False, pool: str = "both") -> WorkerView:
    return WorkerView(wid, pool, True, draining, inflight)


async def test_local_actuator_starts_once_per_missing_replica_and_drains_its_own_newest(monkeypatch) -> None:
    act, bus = local_actuator(monkeypatch)
    base = [view("worker-0", inflight=0)]
    await act.scale("both", 3, base)
    assert len(act.started) == 2
    cmd = act.started[0]
    assert cmd[1:3] == ["-m", "moebus.services.worker"] and "--role" in cmd and cmd[cmd.index("--role") + 1] == "both"
    assert cmd[cmd.index("--model") + 1] == "toy" and cmd[cmd.index("--nats-url") + 1] == "nats://x"
    a, b = sorted(act.children, key=lambda i: act.children[i].seq)
    await act.scale("both", 3, base)  # both still booting: no second start
    assert len(act.started) == 2
    await act.scale("both", 2, base)  # one fewer while booting: stop the newest booting one, no drain
    assert act.children[b].proc.terminated and not bus.requests
    up = [*base, view(a, inflight=5)]
    await act.scale("both", 1, up)  # drain its own (even busier) worker, not the launcher's idle one
    assert bus.requests == [f"moebus.v1.worker.drain.{a}"]
    await act.scale("both", 1, [*base, view(a, inflight=5)])  # not drained twice
    assert len(bus.requests) == 1
    await act.scale("both", 1, [*base, view(a, draining=True)])
    assert len(act.started) == 2 and len(bus.requests) == 1


async def test_local_actuator_drains_the_least_loaded_foreign_worker_when_it_has_none(monkeypatch) -> None:
    act, bus = local_actuator(monkeypatch)
    workers = [view("worker-0", 3), view("worker-1", 1), view("worker-2", 2), view("prefill-0", 0, pool="prefill")]
    await act.scale("both", 2, workers)
    assert bus.requests == ["moebus.v1.worker.drain.worker-1"] and not act.started


def test_every_actuator_satisfies_the_protocol(monkeypatch) -> None:
    from moebus.services.planner.config import KubernetesActuatorConfig

    act, _ = local_actuator(monkeypatch)
    kube = KubernetesActuator(KubernetesActuatorConfig(namespace="x"), apps_api=object())
    assert all(isinstance(a, Actuator) for a in (act, kube, NoActuator()))


def test_decision_message_round_trips() -> None:
    from moebus.shared.messages import PoolDecision, PoolObservation

    d = PlannerDecision(planner_id="planner-0", ts=1.5, ttft_target_s=2, itl_target_s=0.2, actuator="local",
                        pools=[PoolDecision(pool="decode", action="scale_out", desired=3, previous=2, reason="itl",
                                            observed=PoolObservation(replicas=2, itl_p90_s=0.4))])
    assert PlannerDecision.decode(d.encode()) == d
