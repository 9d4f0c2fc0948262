"""PlannerService: watches worker heartbeats, decides each pool's replica count every `interval_s`
(policy.py), publishes the decision on `planner.decision`, exports it as metrics and hands it to
the actuator (none / local / kubernetes; or one passed in)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

from nats.aio.msg import Msg

from moebus.shared.liveness import probe
from moebus.shared.messages import Heartbeat
from moebus.shared.messages.planner import PlannerDecision, PoolDecision
from moebus.shared.service import Service

from .actuator import Actuator, NoActuator
from .config import PlannerConfig
from .fleet import Fleet
from .policy import ScalingPolicy

log = logging.getLogger(__name__)


class PlannerService(Service):
    name = "planner"

    def __init__(self, cfg: PlannerConfig, actuator: Actuator | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: PlannerConfig = cfg
        self.fleet = Fleet(cfg.missed_heartbeats, cfg.rate_window_s)
        self.policy = ScalingPolicy(cfg.policy)
        self.actuator = actuator
        self.last: PlannerDecision | None = None
        self.decisions = 0
        self._ticker: asyncio.Task | None = None
        m = self.metrics
        self._m_desired = m.gauge("desired_replicas", "Replicas decided", ["pool"])
        self._m_current = m.gauge("current_replicas", "Ready, not draining replicas seen", ["pool"])
        self._m_load = m.gauge("predicted_load", "Predicted load in replica-equivalents", ["pool"])
        self._m_capacity = m.gauge("capacity_tokens_per_second", "Learned work tokens/s per replica", ["pool"])
        self._m_ttft = m.gauge("ttft_p90_seconds", "Worst worker's recent p90 TTFT", ["pool"])
        self._m_itl = m.gauge("itl_p90_seconds", "Worst worker's recent p90 inter-token latency", ["pool"])
        self._m_rate = m.gauge("request_rate", "Requests/s accepted by the pool", ["pool"])
        self._m_violated = m.gauge("slo_violated", "1 while the pool misses its SLO", ["pool"])
        self._m_actions = m.counter("scale_actions_total", "Scale decisions taken", ["pool", "action"])
        self._m_errors = m.counter("actuator_errors_total", "Actuator calls that raised", ["pool"])

    def stats(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "last": self.last.model_dump(mode="json") if self.last else None,
                "workers": [asdict(w) for w in self.fleet.workers()],
                "actuator": self.actuator.stats() if self.actuator else {}}

    def _make_actuator(self) -> Actuator:
        c = self.cfg
        if c.actuator == "local":
            from .local import LocalActuator

            defaults = {"nats_url": c.nats_url, "subject_prefix": c.subject_prefix,
                        "heartbeat_interval_s": c.heartbeat_interval_s}
            return LocalActuator(c.local, self.bus, self.subjects, defaults)
        if c.actuator == "kubernetes":
            from .kube import KubernetesActuator

            return KubernetesActuator(c.kubernetes)
        return NoActuator()

    async def setup(self) -> None:
        if self.actuator is None:
            self.actuator = self._make_actuator()
        await self.bus.subscribe(self.subjects.heartbeat_all("worker"), Heartbeat, self._on_heartbeat,
                                 concurrent=False, endpoint="heartbeat")
        self._ticker = self.spawn(self._loop())

    async def teardown(self) -> None:
        if self._ticker is not None:  # no tick may start a worker while the actuator stops them
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self.actuator is not None:
            await self.actuator.close()

    async def _on_heartbeat(self, beat: Heartbeat, _: Msg) -> None:
        self.fleet.observe(beat, time.monotonic())

    async def _loop(self) -> None:
        await asyncio.sleep(self.cfg.warmup_s)  # see the fleet before judging it
        await self._until_pools_seen()
        while True:
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop the planner
                log.exception("planner tick failed")
            await asyncio.sleep(self.cfg.interval_s)

    async def _until_pools_seen(self) -> None:
        """Each pool's min_replicas workers are normally started with the planner (moebus up, the
        Deployments) and take a while to send their first heartbeat (a real model loads for ~15 s):
        wait for them, up to startup_grace_s, so the first tick does not start duplicates."""
        deadline = time.monotonic() + self.cfg.policy.startup_grace_s
        while time.monotonic() < deadline:
            seen: dict[str, int] = {}
            for w in self.fleet.workers():
                if not w.draining:
                    seen[w.pool] = seen.get(w.pool, 0) + 1
            if all(seen.get(pool, 0) >= p.min_replicas for pool, p in self.cfg.policy.pools.items()):
                return
            await asyncio.sleep(0.2)
        log.warning("planner: pools still below min_replicas after %gs; deciding anyway",
                    self.cfg.policy.startup_grace_s)

    async def tick(self) -> PlannerDecision:
        now = time.monotonic()
        # a planner cut off itself forgets nobody; a paused worker, or one across a partition, is kept
        silent = self.fleet.silent(now, self.bus.evidence_since)
        verdicts = await asyncio.gather(*(probe(self.bus, self.subjects, "worker", w, self.cfg.probe_timeout_s,
                                                node=self.fleet.node(w), view=self.cluster_view,
                                                silent_since=self.fleet.seen(w), grace_s=self.cfg.partition_grace_s)
                                          for w in silent))
        self.fleet.forget([w for w, v in zip(silent, verdicts, strict=True) if v == "gone"])
        now = time.monotonic()
        pools = self.policy.decide(self.fleet.observations(), now)
        decision = PlannerDecision(planner_id=self.instance_id, ts=time.time(),
                                   ttft_target_s=self.cfg.policy.ttft_target_s,
                                   itl_target_s=self.cfg.policy.itl_target_s,
                                   actuator=self.actuator.name if self.actuator else "none", pools=pools)
        self.last, self.decisions = decision, self.decisions + 1
        for d in pools:
            self._export(d)
            if d.action != "hold":
                log.info("%s: %s %d -> %d (%s)", d.pool, d.action, d.previous, d.desired, d.reason)
        await self.bus.publish(self.subjects.planner_decision, decision)
        workers = self.fleet.workers()
        for d in pools:
            try:
                await self.actuator.scale(d.pool, d.desired, workers)
            except Exception:
                self._m_errors.labels(d.pool).inc()
                log.exception("actuator %s failed to scale %s to %d", self.actuator.name, d.pool, d.desired)
        return decision

    def _export(self, d: PoolDecision) -> None:
        p, o = d.pool, d.observed
        self._m_desired.labels(p).set(d.desired)
        self._m_current.labels(p).set(o.replicas)
        self._m_load.labels(p).set(d.predicted_load)
        self._m_capacity.labels(p).set(d.capacity_tokens_s)
        self._m_rate.labels(p).set(o.request_rate)
        self._m_violated.labels(p).set(int(d.slo_violated))
        if o.ttft_p90_s is not None:
            self._m_ttft.labels(p).set(o.ttft_p90_s)
        if o.itl_p90_s is not None:
            self._m_itl.labels(p).set(o.itl_p90_s)
        if d.action != "hold":
            self._m_actions.labels(p, d.action).inc()
