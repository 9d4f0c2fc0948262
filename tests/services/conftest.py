"""Fixtures: a real nats-server per test module, and a whole toy-model stack in this process."""
from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from opentelemetry.sdk.trace import TracerProvider

from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.services.frontend import FrontendConfig, start_frontend
from moebus.services.launcher import Stack, StackConfig
from moebus.services.tokenizer import TokenizerConfig, TokenizerService
from moebus.services.worker import WorkerConfig, WorkerService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.nats_server import NatsServer, free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

HEARTBEAT = 0.1  # fast heartbeats: dead workers are noticed in ~0.3 s


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:  # free port, JetStream on, temporary store dir
        yield server


@dataclass
class ToyStack:
    base_url: str
    prefix: str
    nats_url: str
    tokenizer: TokenizerService
    balancer: BalancerService
    workers: list[WorkerService]
    extra: dict[str, Any] = field(default_factory=dict)

    def client(self, api_key: str = "none", **kw: Any) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, **kw)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Until every worker has no request left and all its KV blocks are free."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(not w._active and w._loop.stats.get("num_running", 0) == 0
                   and w._loop.stats.get("kv_blocks_free") == w._loop.stats.get("kv_blocks_total")
                   for w in self.workers):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"workers not idle: {[w.stats() for w in self.workers]}")


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    """Until predicate() (a plain or an async function) is true. Past the deadline the loop gets a
    last few turns before the verdict: after a stall of the whole process (CI's loaded cores) this
    poll can wake before the I/O it waits on is handled."""
    async def met() -> bool:
        ok = predicate()
        return bool(await ok if inspect.isawaitable(ok) else ok)

    deadline = time.monotonic() + timeout
    while not await met():
        if time.monotonic() > deadline:
            for _ in range(10):
                await asyncio.sleep(interval)
                if await met():
                    return
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


@asynccontextmanager
async def toy_stack(nats_url: str, *, workers: int = 1, engine: dict | None = None, worker: dict | None = None,
                    frontend: dict | None = None, tracer_provider: TracerProvider | None = None,
                    tokenizer: dict | None = None, balancer: dict | None = None,
                    engine_factory: Any = None) -> AsyncIterator[ToyStack]:
    """tokenizer + balancer + N workers + frontend on the toy model, isolated by a subject prefix."""
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    common = {"nats_url": nats_url, "subject_prefix": prefix, "heartbeat_interval_s": HEARTBEAT}
    kw = {"tracer_provider": tracer_provider}
    async with AsyncExitStack() as stack:
        tok = await stack.enter_async_context(TokenizerService(TokenizerConfig(model="toy", **(tokenizer or {}), **common), **kw))
        bal = await stack.enter_async_context(BalancerService(BalancerConfig(**(balancer or {}), **common), **kw))
        ws = []
        for i in range(workers):
            cfg = WorkerConfig(model="toy", instance_id=f"worker-{i}", engine={"step_delay_s": 0.002, **(engine or {})},
                               drain_grace_s=2.0, **{**common, **(worker or {})})
            ws.append(await stack.enter_async_context(WorkerService(cfg, engine_factory=engine_factory, **kw)))
        fcfg = FrontendConfig(host="127.0.0.1", port=0, models=["toy"], **(frontend or {}), **common)
        runner, port = await start_frontend(fcfg, tracer_provider)
        stack.push_async_callback(runner.cleanup)
        await wait_for(lambda: len(bal.table.candidates("toy", time.monotonic())) == workers)
        yield ToyStack(f"http://127.0.0.1:{port}", prefix, nats_url, tok, bal, ws)


@pytest.fixture
async def stack(nats_server: NatsServer) -> AsyncIterator[ToyStack]:
    async with toy_stack(nats_server.url) as s:
        yield s


def skip_without_smollm2() -> None:
    try:
        from moebus.text.gguf import embedded_gguf_path

        embedded_gguf_path()
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not available")


def real_model_stack(tmp_path_factory: pytest.TempPathFactory, **cfg: Any) -> Iterator[Stack]:
    """The whole stack as real processes on the embedded SmolLM2 (skipped without it); for module
    fixtures: `yield from real_model_stack(tmp_path_factory, workers=2, ...)`."""
    skip_without_smollm2()
    stack_cfg = StackConfig(**{"port": free_port(), "host": "127.0.0.1", "model": "smollm2",
                               "heartbeat_interval_s": 0.25, "log_dir": str(tmp_path_factory.mktemp("logs")),
                               **cfg})
    with Stack(stack_cfg) as s:
        yield s


async def service_stats(stack: Stack, service: str, instance: str) -> dict:
    """A running stack's service's stats() (Subjects.stats), asked over the bus."""
    bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="test"), Tracing("test"))
    try:
        return (await bus.request(Subjects().stats(service, instance), Empty(), Stats, 5)).stats
    finally:
        await bus.drain()


@dataclass
class UpProcess:
    """A `moebus up` process and where it serves and writes."""

    proc: subprocess.Popen
    url: str  # the API, as its ready line prints it (.../v1)
    log_dir: Path  # every process's log, and prometheus_targets.json

    @property
    def base_url(self) -> str:
        return self.url.removesuffix("/v1")


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after timeout_s: a clean stop where the process allows one."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def moebus_up(log_dir: Path, *args: str, ready_timeout_s: float = 300) -> Iterator[UpProcess]:
    """`moebus up` as an operator runs it (the real CLI, with its supervisor) on the embedded SmolLM2,
    until it prints its ready line; SIGTERM (then SIGKILL) at the end. Skipped without the model."""
    skip_without_smollm2()
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "up.stdout", log_dir / "up.stderr"
    port = free_port()
    with out_path.open("wb") as out, err_path.open("wb") as err:  # files: a pipe nobody reads would block it
        proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "up", "--port", str(port), "--host", "127.0.0.1",
                                 "--log-dir", str(log_dir), "--heartbeat-interval", "0.25", *args],
                                stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not (ready := [line for line in out_path.read_text().splitlines() if line.startswith("moebus up: http")]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"moebus up is not ready (exit code {proc.poll()}): "
                                     f"{err_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield UpProcess(proc, ready[0].split()[2], log_dir)
    finally:
        stop_process(proc, 60)
