"""The supervisor of `moebus up`: restart with backoff, give up after repeated crashes, leave
drained workers down; with real processes, SIGKILLed stateless services come back and neither the
streams in flight nor new requests fail meanwhile."""
from __future__ import annotations

import asyncio
import signal
import threading
from dataclasses import dataclass, field

import openai

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack, StackConfig
from moebus.services.supervisor import RestartPolicy, Supervisor
from moebus.shared.nats_server import free_port

from .test_migration_toy import ENGINE, Reader, _start


@dataclass
class FakeProc:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class FakeStack:
    procs: dict[str, FakeProc] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)
    respawned: list[str] = field(default_factory=list)
    nats_procs: dict[str, FakeProc] = field(default_factory=dict)

    def respawn(self, instance_id: str) -> None:
        self.respawned.append(instance_id)
        self.procs[instance_id] = FakeProc()

    def forget(self, instance_id: str) -> None:
        del self.procs[instance_id], self.services[instance_id]


def test_restarts_with_growing_backoff_then_gives_up() -> None:
    now = [0.0]
    stack = FakeStack({"tokenizer-0": FakeProc()}, {"tokenizer-0": "tokenizer"})
    sup = Supervisor(stack, RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, max_backoff_s=10),
                     clock=lambda: now[0])
    waits = []
    for _ in range(3):
        stack.procs["tokenizer-0"].code = -9
        start = now[0]
        while stack.procs["tokenizer-0"].code is not None:  # down until the supervisor restarts it
            assert sup.check() is None
            now[0] += 0.25
        waits.append(now[0] - start - 0.25)
    assert waits == [1.0, 2.0, 3.0]  # n x backoff_s
    stack.procs["tokenizer-0"].code = 1
    assert "giving up" in sup.check()  # the 4th crash within the window
    now[0] += 200  # an old history is forgiven
    assert sup.check() is None and "tokenizer-0" in sup.due


def test_a_drained_worker_stays_down_and_a_crashed_one_comes_back() -> None:
    stack = FakeStack({"worker-0": FakeProc(0), "worker-1": FakeProc(-9)}, {"worker-0": "worker", "worker-1": "worker"})
    now = [0.0]
    sup = Supervisor(stack, RestartPolicy(backoff_s=0.5), clock=lambda: now[0])
    assert sup.check() is None and "worker-0" not in stack.procs
    now[0] = 1.0
    assert sup.check() is None and stack.respawned == ["worker-1"]


async def test_killed_tokenizer_and_balancer_come_back_and_no_request_fails(tmp_path) -> None:
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=1, heartbeat_interval_s=0.2,
                      engine=ENGINE, log_dir=str(tmp_path), ready_timeout_s=60)
    with Stack(cfg) as stack:
        stop = threading.Event()
        sup = Supervisor(stack, RestartPolicy(backoff_s=0.2))

        def loop() -> None:
            while not stop.wait(0.1):
                assert sup.check() is None

        watcher = threading.Thread(target=loop, daemon=True)
        watcher.start()
        try:
            c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=60)
            readers = await asyncio.gather(*(_start(c, k) for k in range(4)))  # the frontend detokenizes (toy)
            old = {i: stack.procs[i].pid for i in ("tokenizer-0", "balancer-0")}
            for i in old:
                stack.kill(i, signal.SIGKILL)
            fresh = asyncio.create_task(c.chat.completions.create(
                model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=500))
            done: list[Reader] = await asyncio.wait_for(asyncio.gather(*(r.rest() for r in readers)), 20)
            assert [r.text for r in done] == [{0: TOY_REPLY}] * 4
            assert (await asyncio.wait_for(fresh, 20)).choices[0].message.content == TOY_REPLY
            assert all(stack.procs[i].pid != pid for i, pid in old.items())  # restarted, same ids
        finally:
            stop.set()
            watcher.join(5)
