"""Soak (issue 36 item 9): the Azure code trace replayed through `moebus up`'s Stack (real processes,
bus auth on) for MOEBUS_SOAK_S seconds (default 1800) while one random fault strikes every 60 s:
a worker SIGKILLed (restarted at once under its id, as `up()`'s supervisor does: Stack has none),
a process other than nats-server SIGSTOPped for 20 s, or nats-server restarted after 1-5 s down.

At the end: no request lost (each trace request answered 200 with all its forced tokens and
finish_reason "length"; each greedy probe sent among them has its undisturbed text), no process's
VmRSS more than 10% above its value after warm-up (a killed worker's new incarnation counts from
its own warm-up), and every worker's KV blocks all free once the load has drained. `-s` prints
each fault as it happens and the summary RELIABILITY.md records.

    MOEBUS_SOAK_S=300 .venv/bin/python -m pytest -q -s -p no:logging tests/services/test_soak_stack.py -m slow

The real model by default (its KV blocks are real, its greedy text checks a migration's tokens);
MOEBUS_SOAK_MODEL=toy exercises the services and the bus alone. The trace is fitted to a 2-core
machine: every THIN-th request, replayed TIME_SCALE times as fast (the whole hour's shape in half
an hour), prompts x0.05 (<= 512 tokens), outputs <= 32 tokens.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.loadtest.client import RequestRecord, make_client
from moebus.loadtest.formats import read_trace
from moebus.loadtest.prompts import PromptSynth, load_tokenizer
from moebus.loadtest.runner import Pacing, Target, replay
from moebus.loadtest.trace import Shaping, TraceRequest
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import real_model_stack
from .test_bus_blips import metric

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("MOEBUS_SOAK_S", "1800"))
MODEL = os.environ.get("MOEBUS_SOAK_MODEL", "smollm2")  # or "toy" (no torch; services and bus only)
SEED = int(os.environ.get("MOEBUS_SOAK_SEED", "36"))
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_code_2023.csv"
WORKERS = 2
FAULT_EVERY_S, PAUSE_S, NATS_DOWN_S = 60.0, 20.0, (1.0, 5.0)
WARMUP_S = 120.0  # RSS baselines: this long after the load (or a respawned worker) started
RSS_SLACK = 0.10
THIN, TIME_SCALE = 10, 2.0
SHAPING = dict(length_scale=0.05, output_scale=1.0, max_input_tokens=512, max_output_tokens=32)
PROBE_EVERY_S = 20.0  # a greedy request with a known answer, among the trace's
PROBES = ["Write a short poem about the sea.", "Name three colours.", "What is a prime number?"]
PROBE_TOKENS = 24


@pytest.fixture(scope="module")
def spawner():
    """Where restarts run: a child dies with the thread that spawned it (shared/lifeline.py), so
    that thread must outlive the stack, not end with the fault loop."""
    with ThreadPoolExecutor(1, thread_name_prefix="soak-spawner") as pool:
        yield pool


@pytest.fixture(scope="module")
def stack(spawner, tmp_path_factory):
    if not TRACE.exists():
        pytest.skip(f"no trace at {TRACE}")
    if MODEL != "toy":
        pytest.importorskip("torch")
        yield from real_model_stack(tmp_path_factory, workers=WORKERS, worker={"torch_threads": 1},
                                    engine={"max_model_len": 1024, "num_kv_blocks": 256}, ready_timeout_s=300)
        return
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=WORKERS, heartbeat_interval_s=0.25,
                      engine={"step_delay_s": 0.05, "max_num_seqs": 16, "max_model_len": 4096, "num_blocks": 2048},
                      kvbroker=True,
                      log_dir=str(tmp_path_factory.mktemp("logs")), ready_timeout_s=60)
    with Stack(cfg) as s:
        yield s


@dataclass
class Fault:
    at_s: float
    kind: str  # sigkill | sigstop | nats
    victim: str
    detail: str = ""


@dataclass
class Chaos:
    """Every FAULT_EVERY_S one random fault, from a thread (each blocks: a pause, a NATS outage)."""

    stack: Stack
    spawner: ThreadPoolExecutor
    rng: random.Random
    t0: float
    faults: list[Fault] = field(default_factory=list)
    error: BaseException | None = None  # what stopped the fault loop early
    born: dict[str, float] = field(default_factory=dict)  # respawned instance -> when (s from t0)

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(FAULT_EVERY_S):
                kind = self.rng.choice(["sigkill", "sigstop", "nats"])
                at = time.monotonic() - self.t0
                fault = getattr(self, kind)(at)
                self.faults.append(fault)
                print(f"soak +{at:.0f}s: {fault.kind} {fault.victim} {fault.detail}", flush=True)
        except BaseException as e:  # reported by the test
            self.error = e

    def sigkill(self, at: float) -> Fault:
        victim = self.rng.choice(sorted(i for i, s in self.stack.services.items() if s == "worker"))
        proc = self.stack.procs[victim]
        self.stack.kill(victim, signal.SIGKILL)
        proc.wait(10)
        self.spawner.submit(self.stack.respawn, victim).result()
        self.born[victim] = time.monotonic() - self.t0
        return Fault(at, "sigkill", victim, f"pid {proc.pid} -> {self.stack.procs[victim].pid}")

    def sigstop(self, at: float) -> Fault:
        victim = self.rng.choice(sorted(self.stack.procs))
        pid = self.stack.procs[victim].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        return Fault(at, "sigstop", victim, f"{PAUSE_S:g}s")

    def nats(self, at: float) -> Fault:
        down = round(self.rng.uniform(*NATS_DOWN_S), 1)
        self.spawner.submit(self.stack.restart_nats, down).result()
        return Fault(at, "nats", "nats-0", f"down {down:g}s")


def rss_kib(pid: int) -> tuple[int, int] | None:
    """VmRSS and RssAnon (KiB): all resident pages, and the heap's (file pages come and go with the
    page cache under memory pressure; with no swap, anonymous ones stay until freed)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


@dataclass
class RssWatch:
    """Each process incarnation's RSS: the first sample WARMUP_S after it started under load, and the peak."""

    stack: Stack
    chaos: Chaos
    base: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    peak: dict[tuple[str, int], int] = field(default_factory=dict)

    def sample(self) -> None:
        now = time.monotonic() - self.chaos.t0
        for instance, proc in list(self.stack.procs.items()):
            if proc.poll() is not None or (kib := rss_kib(proc.pid)) is None:
                continue
            key = (instance, proc.pid)
            self.peak[key] = max(kib[0], self.peak.get(key, 0))
            if key not in self.base and now - self.chaos.born.get(instance, 0.0) >= WARMUP_S:
                self.base[key] = kib

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(5.0):
            self.sample()

    def table(self) -> tuple[list[str], list[str]]:
        """Markdown rows, and the incarnations whose VmRSS grew more than RSS_SLACK."""
        rows, over = [], []
        for instance, proc in sorted(self.stack.procs.items()):
            key, end = (instance, proc.pid), rss_kib(proc.pid)
            if key not in self.base or end is None:
                now = "-" if end is None else f"{end[0] / 1024:.1f}"
                rows.append(f"| {instance} | {proc.pid} | - | {now} | - | - | - | not {WARMUP_S:g} s old |")
                continue
            (rss0, anon0), (rss1, anon1) = self.base[key], end
            change = rss1 / rss0 - 1
            rows.append(f"| {instance} | {proc.pid} | {rss0 / 1024:.1f} | {rss1 / 1024:.1f} | "
                        f"{self.peak[key] / 1024:.1f} | {change:+.1%} | {anon1 / anon0 - 1:+.1%} | |")
            if change > RSS_SLACK:
                over.append(f"{instance} {change:+.1%}")
        return rows, over


def trace_requests() -> list[TraceRequest]:
    reqs = read_trace(TRACE)[::THIN]
    return Shaping(time_scale=TIME_SCALE, duration_s=SOAK_S * TIME_SCALE, **SHAPING).apply(reqs)


async def probe(client, model: str, prompt: str) -> str:
    """One greedy streamed chat: its text."""
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=PROBE_TOKENS if model != "toy" else 200,
                                                  temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def probes(client, model: str, want: dict[str, str], stop: asyncio.Event, out: list[bool]) -> None:
    async def one(prompt: str) -> None:
        try:
            out.append(await probe(client, model, prompt) == want[prompt])
        except Exception as e:  # counted as lost, with its reason
            print(f"soak: probe failed: {type(e).__name__}: {e}", flush=True)
            out.append(False)

    tasks, i = [], 0
    while not stop.is_set():
        tasks.append(asyncio.create_task(one(PROBES[i % len(PROBES)])))
        i += 1
        try:
            await asyncio.wait_for(stop.wait(), PROBE_EVERY_S)
        except TimeoutError:
            pass
    await asyncio.gather(*tasks)


async def worker_stats(stack: Stack) -> dict[str, dict]:
    connect = Bus.connect(BusConfig(servers=[stack.nats_url], name="soak"), Tracing("soak"))
    bus = await asyncio.wait_for(connect, 30)
    try:
        return {w: (await bus.request(Subjects().stats("worker", w), Empty(), Stats, 5)).stats
                for w, s in sorted(stack.services.items()) if s == "worker"}
    finally:
        await bus.drain()


async def drained(stack: Stack, timeout: float = 60.0) -> dict[str, dict]:
    """Every worker's stats once none runs anything and its KV blocks are all free (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await worker_stats(stack)
        idle = all(s["active_requests"] == 0 and s["engine"]["num_running"] == 0 and
                   s["engine"]["kv_blocks_free"] == s["engine"]["kv_blocks_total"] for s in stats.values())
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(1.0)


def whole(r: RequestRecord) -> bool:
    return r.ok and r.finish_reason == "length" and r.completion_tokens == r.output_tokens


def p(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else float("nan")


async def test_soak(stack: Stack, spawner: ThreadPoolExecutor) -> None:
    model = "toy" if MODEL == "toy" else "smollm2"
    print(f"\nsoak: logs in {stack.cfg.log_dir}", flush=True)
    reqs = trace_requests()
    synth = PromptSynth(load_tokenizer("smollm2"), Shaping(**SHAPING).block_tokens, SEED)
    prompts = [synth.prompt(r, i) for i, r in enumerate(reqs)]
    client = make_client(stack.url, timeout_s=600)
    want = {q: TOY_REPLY if model == "toy" else await probe(client, model, q) for q in PROBES}  # undisturbed

    chaos = Chaos(stack, spawner, random.Random(SEED), time.monotonic())
    rss = RssWatch(stack, chaos)
    stop_faults, stop_rss = threading.Event(), threading.Event()
    threads = [threading.Thread(target=chaos.run, args=(stop_faults,), daemon=True),
               threading.Thread(target=rss.run, args=(stop_rss,), daemon=True)]
    for t in threads:
        t.start()
    records: list[RequestRecord] = []
    stop_probes, probed = asyncio.Event(), []
    prober = asyncio.create_task(probes(client, model, want, stop_probes, probed))
    try:
        records = await replay(Target(client, model), reqs, prompts, Pacing(max_in_flight=32), lambda _: None,
                               progress=False)
        await asyncio.sleep(SOAK_S - (time.monotonic() - chaos.t0))  # the window's quiet tail: faults and probes go on
    finally:
        stop_faults.set()
        stop_probes.set()
        await prober
        await asyncio.to_thread(threads[0].join, PAUSE_S + 30)
    elapsed = time.monotonic() - chaos.t0
    stats = await drained(stack)
    rss.sample()
    stop_rss.set()
    rows, over = rss.table()
    moved = {k: await metric(stack.url, "moebus_frontend_migrations_total", f'kind="{k}"') for k in ("resumed", "fresh")}
    balancer = f"http://127.0.0.1:{stack.metrics_ports['balancer-0'][1]}"
    workers_lost = await metric(balancer, "moebus_balancer_workers_lost_total")

    lost = [r for r in records if not whole(r)]
    kinds = {k: sum(f.kind == k for f in chaos.faults) for k in ("sigkill", "sigstop", "nats")}
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    lag = [r.sent_s - r.scheduled_s for r in records]
    kv = {w: f"{s['engine']['kv_blocks_free']}/{s['engine']['kv_blocks_total']}" for w, s in stats.items()}
    print(f"\n## soak: {elapsed:.0f} s, model {model}, {WORKERS} workers, seed {SEED}\n"
          f"trace: azure_code_2023 every {THIN}th request x{TIME_SCALE:g} speed ({len(reqs)} requests over "
          f"{reqs[-1].arrival_s:.0f} s, {len(reqs) / max(reqs[-1].arrival_s, 1):.2f} req/s), prompts x0.05 <= 512, "
          f"outputs <= 32 tokens (mean {statistics.mean(r.output_tokens for r in reqs):.1f})\n"
          f"| faults (sigkill / sigstop {PAUSE_S:g}s / nats restart) | requests | lost | probes identical | "
          f"migrations resumed / fresh | workers declared lost | TTFT p50 / p90 s | E2E p50 / p90 s | send lag p90 s |\n"
          f"| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |\n"
          f"| {len(chaos.faults)} ({kinds['sigkill']} / {kinds['sigstop']} / {kinds['nats']}) | {len(records)} | "
          f"{len(lost)} | {sum(probed)} of {len(probed)} | {moved['resumed']:.0f} / {moved['fresh']:.0f} | "
          f"{workers_lost:.0f} | {p(ttft, .5):.2f} / {p(ttft, .9):.2f} | {p(e2e, .5):.2f} / {p(e2e, .9):.2f} | "
          f"{p(lag, .9):.2f} |\n"
          f"KV blocks free/total after the drain: {kv}\n"
          f"| process | pid | VmRSS after warm-up MiB | at the end MiB | peak MiB | change | RssAnon change | |\n"
          f"| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n" + "\n".join(rows), flush=True)
    for r in lost[:20]:
        print(f"soak: lost #{r.index} status {r.status} finish {r.finish_reason} tokens {r.completion_tokens}/"
              f"{r.output_tokens} sent +{r.sent_s:.0f}s: {r.error}", flush=True)

    assert chaos.error is None, f"the fault loop failed: {chaos.error!r}"
    assert len(records) == len(reqs) and not lost, f"{len(lost)} of {len(records)} requests lost"
    assert probed and all(probed), f"{probed.count(False)} of {len(probed)} probes lost or changed"
    assert all(s["engine"]["kv_blocks_free"] == s["engine"]["kv_blocks_total"] for s in stats.values()), kv
    assert not over, f"RSS grew more than {RSS_SLACK:.0%}: {over}"
    assert all(proc.poll() is None for proc in stack.procs.values()), "a process died"
