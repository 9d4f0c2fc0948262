"""Autoscaling on a rising-then-falling load (issue 15, item 5): replicas over time, SLO attainment,
requests lost.

    python loadtest/autoscale_run.py                       # ~7 min on 2 cores; results in --out,
                                                           # default ~/.cache/moebus/loadtest/autoscale-ramp/

1. writes a seeded Mooncake-format trace (trace.jsonl: `timestamp` ms, `input_length`,
   `output_length`, `hash_ids`): Poisson arrivals whose rate holds at --base-rate, ramps linearly
   to --peak-rate, holds, ramps back down and holds at the base again;
2. starts the stack on the real model with `autoscale=(MIN, MAX)` (what `moebus up --autoscale`
   runs: MIN workers and a planner with the local actuator), 1 torch thread per worker, on
   127.0.0.1 only, with the planner knobs in PLANNER (stated in the run's autoscale.json);
3. records every `planner.decision` on the bus to decisions.jsonl;
4. replays the trace open loop on its own clock with `moebus loadtest run --format mooncake`
   into the same folder (requests.jsonl, summary.json, meta.json, the tool's plots);
5. keeps the stack up until the planner is back at MIN (or --settle-timeout), then stops it;
6. plots replicas.png (replicas current/desired, offered and served request rate, TTFT p90 against
   the SLO) and prints/writes the summary (autoscale.json).

Every wait is bounded; the `with Stack(...)` block stops every process it started (the planner
stops the workers it started itself).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moebus.loadtest.cli import default_results_dir  # noqa: E402
from moebus.services.launcher import Stack, StackConfig, _merged  # noqa: E402
from moebus.shared.bus import Bus, BusConfig  # noqa: E402
from moebus.shared.messages.planner import PlannerDecision  # noqa: E402
from moebus.shared.nats_server import free_port  # noqa: E402
from moebus.shared.subjects import Subjects  # noqa: E402
from moebus.shared.tracing import Tracing  # noqa: E402

OUT = default_results_dir() / "autoscale-ramp"  # out of the source tree; --out for another place
TTFT_SLO_S, ITL_SLO_S = 2.0, 0.3

# The planner's knobs for a 2-core CPU and SmolLM2 at 1 torch thread per worker (docs/planner.md).
# capacity_tokens_s is what one worker was measured to serve within TTFT 2 s / ITL 0.3 s before
# choosing them (1 worker, 64-token prompts, 16 output tokens, open loop; work tokens = 64 x 0.25 +
# 16 per request; the run: docs/benchmarks/history-fleet.md, "Autoscaling on a rising-then-falling
# load"); the default prior (200 work tokens/s) would never see a CPU worker as loaded, and the
# default ITL target (0.2 s) is about what a single 64-token prefill between two decode steps
# already costs on such a CPU. warmup_s 30: the planner starts with the launcher's MIN workers, and
# a real-model worker loads its model before its first heartbeat on 2 busy cores; with the default 3 s the planner's first tick
# sees an empty pool and starts one more worker ("below min_replicas"), stopped again a few seconds later.
PLANNER: dict[str, Any] = {
    "interval_s": 3.0,
    "warmup_s": 30.0,
    "policy": {
        "ttft_target_s": TTFT_SLO_S, "itl_target_s": ITL_SLO_S,
        "scale_out_cooldown_s": 15.0, "scale_in_cooldown_s": 30.0, "scale_in_stable_s": 20.0,
        "startup_grace_s": 90.0,
        "pools": {"both": {"capacity_tokens_s": 35.0, "target_inflight": 4.0}},
    },
}


def rate_at(t: float, a: argparse.Namespace) -> float:
    """Offered request rate (req/s) at trace time t: base, ramp up, peak, ramp down, base (tail)."""
    t1 = a.base_s
    t2 = t1 + a.ramp_s
    t3 = t2 + a.peak_s
    t4 = t3 + a.ramp_s
    if t < t1 or t >= t4:
        return a.base_rate
    if t < t2:
        return a.base_rate + (a.peak_rate - a.base_rate) * (t - t1) / a.ramp_s
    if t < t3:
        return a.peak_rate
    return a.peak_rate - (a.peak_rate - a.base_rate) * (t - t3) / a.ramp_s


def phases(a: argparse.Namespace) -> dict[str, float]:
    ramp_up = a.base_s
    peak = ramp_up + a.ramp_s
    ramp_down = peak + a.peak_s
    low = ramp_down + a.ramp_s
    return {"ramp_up": ramp_up, "peak": peak, "ramp_down": ramp_down, "low": low, "end": low + a.tail_s}


def write_trace(path: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Non-homogeneous Poisson arrivals by thinning, seeded; the first request at t = 0 (the replay
    clock starts with it); unique hash ids (no prefix sharing)."""
    rng = random.Random(a.seed)
    end, lam = phases(a)["end"], max(a.base_rate, a.peak_rate)
    times, t = [0.0], 0.0
    while True:
        t += rng.expovariate(lam)
        if t >= end:
            break
        if rng.random() < rate_at(t, a) / lam:
            times.append(t)
    rows = [{"timestamp": round(t * 1000), "input_length": rng.randint(a.input_min, a.input_max),
             "output_length": rng.randint(a.output_min, a.output_max), "hash_ids": [i]}
            for i, t in enumerate(times)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def decision_row(d: PlannerDecision) -> dict[str, Any]:
    row: dict[str, Any] = {"ts": d.ts, "pools": {}}
    for p in d.pools:
        o = p.observed
        row["pools"][p.pool] = {
            "action": p.action, "previous": p.previous, "desired": p.desired, "current": o.replicas,
            "draining": o.draining, "reason": p.reason, "slo_violated": p.slo_violated,
            "ttft_p90_s": o.ttft_p90_s, "itl_p90_s": o.itl_p90_s, "request_rate": o.request_rate,
            "num_running": o.num_running, "num_waiting": o.num_waiting,
            "predicted_load": p.predicted_load, "capacity_tokens_s": p.capacity_tokens_s}
    return row


class Recorder:
    """Planner decisions off the bus, and the replay's clock origin (wall time of its t = 0)."""

    def __init__(self, path: Path, requests: Path) -> None:
        self.path, self.requests = path, requests
        self.rows: list[dict[str, Any]] = []
        self.t0: float | None = None  # wall time of the replay's t = 0, from the records' done_s
        self._seen = 0
        self._f = path.open("w", encoding="utf-8")

    async def on_decision(self, d: PlannerDecision, _msg: Any) -> None:
        row = decision_row(d)
        self.rows.append(row)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        both = row["pools"].get("both", {})
        print(f"  planner: {both.get('action')} {both.get('previous')}->{both.get('desired')} "
              f"(seen {both.get('current')}, draining {both.get('draining')}) {both.get('reason')}", flush=True)

    def poll_requests(self) -> None:
        """Each finished record fixes t0 <= now - done_s; the smallest bound is within a poll of it."""
        if not self.requests.exists():
            return
        now = time.time()
        with self.requests.open(encoding="utf-8") as f:
            lines = f.readlines()
        for line in lines[self._seen:]:
            if line.endswith("\n"):
                est = now - json.loads(line)["done_s"]
                self.t0 = est if self.t0 is None else min(self.t0, est)
                self._seen += 1

    def last(self) -> dict[str, Any] | None:
        return self.rows[-1]["pools"].get("both") if self.rows else None

    def close(self) -> None:
        self._f.close()


async def drive(stack: Stack, a: argparse.Namespace, rec: Recorder, trace: Path) -> dict[str, Any]:
    bus = await Bus.connect(BusConfig(servers=[stack.nats_url], name="autoscale-run"), Tracing("autoscale-run"))
    await bus.subscribe(Subjects().planner_decision, PlannerDecision, rec.on_decision)
    timing: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 60
        while rec.last() is None and time.monotonic() < deadline:  # the planner is deciding
            await asyncio.sleep(0.2)
        cmd = [sys.executable, "-m", "moebus.cli", "loadtest", "run", "--trace", str(trace), "--format", "mooncake",
               "--url", stack.url, "--out", str(a.out), "--max-in-flight", str(a.max_in_flight),
               "--slo-ttft-ms", str(TTFT_SLO_S * 1000), "--slo-itl-ms", str(ITL_SLO_S * 1000),
               "--prompt-seed", str(a.seed), "--timeout", "300", "--no-progress"]
        timing["loadtest_cmd"] = " ".join(cmd[2:])
        print("+", " ".join(cmd), flush=True)
        limit = phases(a)["end"] + a.loadtest_slack_s
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO)
        timing["loadtest_launched"] = time.time()
        try:
            while True:
                try:
                    await asyncio.wait_for(proc.wait(), 0.2)
                    break
                except TimeoutError:
                    rec.poll_requests()
                    if time.time() - timing["loadtest_launched"] > limit:
                        print(f"loadtest still running after {limit:.0f}s: interrupting it", flush=True)
                        proc.send_signal(2)  # SIGINT: it stops sending and still writes what finished
                        await asyncio.wait_for(proc.wait(), 60)
                        break
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        rec.poll_requests()
        timing["loadtest_rc"] = proc.returncode
        timing["loadtest_done"] = time.time()
        print(f"loadtest finished (rc {proc.returncode}); waiting for the planner to scale back in "
              f"(at most {a.settle_timeout_s:.0f}s)", flush=True)
        deadline = time.monotonic() + a.settle_timeout_s
        while time.monotonic() < deadline:
            p = rec.last()
            if p and p["desired"] == a.min and p["current"] == a.min and p["draining"] == 0 and \
                    any(r["pools"]["both"]["desired"] > a.min for r in rec.rows):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2 * PLANNER["interval_s"])  # a couple more decisions at rest
        timing["settled"] = time.time()
    finally:
        await bus.drain()
    return timing


def load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def meets_slo(r: dict[str, Any]) -> bool:
    gaps = r.get("itl_s") or []
    return r.get("status") == 200 and r.get("ttft_s") is not None and r["ttft_s"] <= TTFT_SLO_S and \
        (not gaps or sum(gaps) / len(gaps) <= ITL_SLO_S)


def by_phase(recs: list[dict[str, Any]], ph: dict[str, float]) -> dict[str, list[float | int]]:
    """[requests, share meeting the SLO] per phase of the load, by scheduled time (the tool's goodput rule)."""
    edges = [("base", 0.0, ph["ramp_up"]), ("ramp_up", ph["ramp_up"], ph["peak"]),
             ("peak", ph["peak"], ph["ramp_down"]), ("ramp_down", ph["ramp_down"], ph["low"]),
             ("tail", ph["low"], math.inf)]
    out: dict[str, list[float | int]] = {}
    for name, lo, hi in edges:
        rs = [r for r in recs if lo <= r["scheduled_s"] < hi]
        out[name] = [len(rs), round(sum(map(meets_slo, rs)) / len(rs), 3) if rs else 0.0]
    return out


def in_flight(recs: list[dict[str, Any]], t: float) -> int:
    return sum(1 for r in recs if r["sent_s"] <= t <= (r.get("done_s") or math.inf))


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def analyse(a: argparse.Namespace, rows: list[dict[str, Any]], t0: float, trace_rows: list[dict[str, Any]],
            timing: dict[str, Any], env: dict[str, Any], planner: dict[str, Any]) -> dict[str, Any]:
    ph = phases(a)
    summary = json.loads((a.out / "summary.json").read_text()) if (a.out / "summary.json").exists() else {}
    recs = load_records(a.out / "requests.jsonl")
    pools = [(r["ts"] - t0, r["pools"]["both"]) for r in rows if "both" in r["pools"]]
    outs = [(t, p) for t, p in pools if p["action"] == "scale_out" and t >= ph["ramp_up"] - a.base_s]
    first_out = next(((t, p) for t, p in outs), None)
    first_more = next((t for t, p in pools if p["current"] > a.min and t >= 0), None)
    max_current = max((p["current"] for _, p in pools), default=0)
    max_desired = max((p["desired"] for _, p in pools), default=0)
    peak_t = max((t for t, p in pools if p["desired"] == max_desired), default=None)
    back_desired = next((t for t, p in pools if peak_t is not None and t > peak_t and p["desired"] == a.min), None)
    back_seen = next((t for t, p in pools if back_desired is not None and t >= back_desired
                      and p["current"] == a.min and p["draining"] == 0), None)
    failed = summary.get("errors", 0) + summary.get("rejected", 0) + summary.get("cancelled", 0)
    planned = len(trace_rows)
    lost = planned - summary.get("ok", 0)

    def since(t: float | None, ref: float) -> float | None:
        return None if t is None else round(t - ref, 1)

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
        "env": env,
        "load": {"base_rate": a.base_rate, "peak_rate": a.peak_rate, "phases_s": ph, "seed": a.seed,
                 "input_tokens": [a.input_min, a.input_max], "output_tokens": [a.output_min, a.output_max],
                 "requests_in_trace": planned, "max_in_flight": a.max_in_flight},
        "stack": {"model": a.model, "autoscale": [a.min, a.max], "torch_threads": a.torch_threads},
        "planner": planner, "slo": {"ttft_s": TTFT_SLO_S, "itl_s": ITL_SLO_S},
        "requests": {"sent": summary.get("requests", len(recs)), "completed": summary.get("ok"),
                     "failed": failed, "not_completed": lost,
                     "errors": [r.get("error") for r in recs if r.get("error")][:5]},
        "slo_attainment": summary.get("goodput_fraction"),
        "slo_attainment_by_phase": by_phase(recs, ph),
        "ttft_s": summary.get("ttft_s"), "itl_s": summary.get("itl_s"), "e2e_s": summary.get("e2e_s"),
        "req_per_s": summary.get("req_per_s"), "duration_s": summary.get("duration_s"),
        "replicas": {"min_seen": min((p["current"] for t, p in pools if 0 <= t), default=None),
                     "max_seen": max_current, "max_desired": max_desired},
        "scale_out": {"first_decision_after_ramp_start_s": since(first_out[0] if first_out else None, ph["ramp_up"]),
                      "first_decision_reason": first_out[1]["reason"] if first_out else None,
                      "second_replica_serving_after_ramp_start_s": since(first_more, ph["ramp_up"]),
                      "decisions": [(round(t, 1), p["previous"], p["desired"], p["reason"]) for t, p in outs]},
        "scale_in": {"back_to_min_decided_after_ramp_end_s": since(back_desired, ph["low"]),
                     "back_to_min_serving_after_ramp_end_s": since(back_seen, ph["low"]),
                     "after_last_request_done_s": since(back_seen, max((r["done_s"] for r in recs), default=0.0)),
                     "decisions": [(round(t, 1), p["previous"], p["desired"], p["reason"])
                                   for t, p in pools if p["action"] == "scale_in"],
                     # requests in flight (client side) when each drain was decided, and +-10 s around it
                     "in_flight_at_drain": [in_flight(recs, t) for t, p in pools if p["action"] == "scale_in"],
                     "requests_overlapping_drain_10s": [sum(1 for r in recs if r["sent_s"] <= t + 10
                                                            and (r.get("done_s") or 0) >= t - 10)
                                                        for t, p in pools if p["action"] == "scale_in"]},
        "timing": {k: v for k, v in timing.items() if k != "loadtest_cmd"},
        "loadtest_cmd": timing.get("loadtest_cmd"),
    }
    return out


def plot(a: argparse.Namespace, rows: list[dict[str, Any]], t0: float, trace_rows: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ph = phases(a)
    recs = load_records(a.out / "requests.jsonl")
    pools = [(r["ts"] - t0, r["pools"]["both"]) for r in rows if "both" in r["pools"]]
    ts = [t for t, _ in pools]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for ax in (ax1, ax2, ax3):
        for key, color in (("ramp_up", "tab:orange"), ("ramp_down", "tab:blue")):
            start = ph[key]
            ax.axvspan(start, start + a.ramp_s, color=color, alpha=0.07)
        ax.axvspan(ph["peak"], ph["ramp_down"], color="tab:red", alpha=0.07)
        ax.grid(alpha=0.3)
    ax1.step(ts, [p["current"] for _, p in pools], where="post", label="current (ready, not draining)", lw=2)
    ax1.step(ts, [p["desired"] for _, p in pools], where="post", label="desired (planner)", ls="--")
    ax1.step(ts, [p["draining"] for _, p in pools], where="post", label="draining", ls=":", color="gray")
    ax1.set_ylabel("workers")
    ax1.set_yticks(range(0, a.max + 2))
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"Autoscaling {a.min}:{a.max}, SmolLM2 on 2 CPU cores: "
                  f"{a.base_rate:g} -> {a.peak_rate:g} -> {a.base_rate:g} req/s")

    grid = [i * 0.5 for i in range(int(ph["end"] * 2) + 1)]
    ax2.plot(grid, [rate_at(t, a) for t in grid], label="offered (trace intensity)", color="black", lw=1)
    width = 10.0
    nbins = int(math.ceil(max([ph["end"], *[r.get("done_s") or 0 for r in recs]]) / width)) + 1
    arr = [0] * nbins
    for r in trace_rows:
        arr[int(r["timestamp"] / 1000 / width)] += 1
    done = [0] * nbins
    for r in recs:
        if r.get("status") == 200 and r.get("done_s") is not None:
            done[int(r["done_s"] / width)] += 1
    centers = [(i + 0.5) * width for i in range(nbins)]
    ax2.step(centers, [n / width for n in arr], where="mid", label=f"sent ({width:g} s bins)", alpha=0.7)
    ax2.step(centers, [n / width for n in done], where="mid", label="completed", alpha=0.7)
    ax2.plot(ts, [p["request_rate"] for _, p in pools], ".", ms=4, label="accepted, as the planner saw it")
    ax2.set_ylabel("requests / s")
    ax2.legend(loc="upper right", fontsize=8)

    ax3.plot(ts, [p["ttft_p90_s"] if p["ttft_p90_s"] is not None else math.nan for _, p in pools], ".-", ms=4,
             label="TTFT p90, worst worker, last 30 s (planner's input)")
    sent = sorted((r["sent_s"] + (r["ttft_s"] or 0), r["ttft_s"]) for r in recs if r.get("ttft_s") is not None)
    cx, cy = [], []
    for i in range(nbins):
        window = [y for x, y in sent if i * width <= x < (i + 1) * width]
        if window:
            cx.append(centers[i])
            cy.append(percentile(window, 0.9))
    ax3.step(cx, cy, where="mid", label=f"TTFT p90, client, first tokens per {width:g} s", alpha=0.8)
    ax3.axhline(TTFT_SLO_S, color="red", ls="--", label=f"SLO {TTFT_SLO_S:g} s")
    ax3.set_yscale("log")
    ax3.set_ylabel("TTFT p90 (s)")
    ax3.set_xlabel("seconds since the first request")
    ax3.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = a.out / "replicas.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(s: dict[str, Any]) -> str:
    r, so, si = s["requests"], s["scale_out"], s["scale_in"]
    att = s["slo_attainment"]
    lines = [
        f"requests sent {r['sent']}, completed {r['completed']}, failed {r['failed']} "
        f"(not completed: {r['not_completed']})",
        f"SLO attainment (TTFT <= {TTFT_SLO_S:g} s and mean ITL <= {ITL_SLO_S:g} s): "
        f"{'n/a' if att is None else f'{100 * att:.1f}%'}",
        "by phase [requests, SLO share]: " + ", ".join(f"{k} {v}" for k, v in s["slo_attainment_by_phase"].items()),
        f"replicas: min {s['replicas']['min_seen']}, max {s['replicas']['max_seen']} "
        f"(max desired {s['replicas']['max_desired']})",
        f"scale-out: first decision {so['first_decision_after_ramp_start_s']} s after the ramp started "
        f"({so['first_decision_reason']}); 2nd worker serving after {so['second_replica_serving_after_ramp_start_s']} s",
        f"scale-in: back to MIN decided {si['back_to_min_decided_after_ramp_end_s']} s after the ramp down ended, "
        f"serving at MIN after {si['back_to_min_serving_after_ramp_end_s']} s "
        f"({si['after_last_request_done_s']} s after the last request finished); requests in flight when each "
        f"drain was decided: {si['in_flight_at_drain']}, overlapping +-10 s: {si['requests_overlapping_drain_10s']}",
    ]
    if s["ttft_s"]:
        lines.append("TTFT p50/p90/p99 s: " + " / ".join(f"{s['ttft_s'][k]:.2f}" for k in ("p50", "p90", "p99")) +
                     "; ITL p50/p90/p99 s: " + " / ".join(f"{s['itl_s'][k]:.3f}" for k in ("p50", "p90", "p99")))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="0: a free port (on 127.0.0.1)")
    p.add_argument("--base-rate", type=float, default=0.3, help="req/s before and after the ramp")
    p.add_argument("--peak-rate", type=float, default=2.5, help="req/s at the top")
    p.add_argument("--base-s", type=float, default=20.0, help="seconds at the base rate before the ramp")
    p.add_argument("--tail-s", type=float, default=100.0,
                   help="seconds at the base rate after it (the scale-in should happen under this traffic)")
    p.add_argument("--ramp-s", type=float, default=90.0, help="seconds of each ramp")
    p.add_argument("--peak-s", type=float, default=60.0, help="seconds at the peak")
    p.add_argument("--input-min", type=int, default=48)
    p.add_argument("--input-max", type=int, default=80)
    p.add_argument("--output-min", type=int, default=12)
    p.add_argument("--output-max", type=int, default=20)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--loadtest-slack-s", type=float, default=240.0, help="the replay may overrun the trace by this")
    p.add_argument("--settle-timeout-s", type=float, default=180.0, help="wait for the scale-in at most this")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temp dir, printed)")
    p.add_argument("--engine", type=json.loads, default={}, help="extra EngineConfig fields (JSON), e.g. for the toy")
    p.add_argument("--planner", type=json.loads, default={},
                   help='PlannerConfig fields merged over PLANNER, e.g. \'{"policy": {"capacity_alpha": 0}}\'')
    p.add_argument("--report-only", action="store_true",
                   help="no run: rebuild autoscale.json and replicas.png from --out (give the run's load flags)")
    a = p.parse_args()
    if a.report_only:
        return write_report(a)
    PLANNER.update(_merged(PLANNER, a.planner))
    a.out.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "summary.json", "decisions.jsonl", "autoscale.json", "replicas.png"):
        (a.out / stale).unlink(missing_ok=True)

    trace = a.out / "trace.jsonl"
    trace_rows = write_trace(trace, a)
    print(f"trace: {len(trace_rows)} requests over {phases(a)['end']:.0f}s -> {trace}", flush=True)
    env = {"uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "cpus": os.cpu_count()}
    print("uptime before:", env["uptime_before"], flush=True)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="autoscale-run-")
    print("service logs:", log_dir, flush=True)
    cfg = StackConfig(port=a.port or free_port(), host="127.0.0.1", model=a.model, autoscale=(a.min, a.max),
                      worker={"torch_threads": a.torch_threads}, engine=a.engine, planner=PLANNER, log_dir=log_dir,
                      ready_timeout_s=300.0)
    rec = Recorder(a.out / "decisions.jsonl", a.out / "requests.jsonl")
    started = time.time()
    try:
        with Stack(cfg) as stack:
            print(f"stack up in {time.time() - started:.0f}s at {stack.url}", flush=True)
            timing = asyncio.run(drive(stack, a, rec, trace))
            stopping = time.time()
        timing["stack_stopped_in_s"] = round(time.time() - stopping, 1)
    finally:
        rec.close()
    env["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = rec.t0 if rec.t0 is not None else timing["loadtest_launched"]
    timing["wall_s"] = round(time.time() - started, 1)
    for k in ("loadtest_launched", "loadtest_done", "settled"):
        timing[k] = round(timing[k] - t0, 1)  # seconds since the replay's t = 0
    rel = [dict(r, t=round(r["ts"] - t0, 2)) for r in rec.rows]  # decisions.jsonl gets the replay clock too
    (a.out / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rel))
    return finish(a, rec.rows, t0, trace_rows, timing, env)


def finish(a: argparse.Namespace, rows: list[dict[str, Any]], t0: float, trace_rows: list[dict[str, Any]],
           timing: dict[str, Any], env: dict[str, Any], planner: dict[str, Any] = PLANNER) -> int:
    s = analyse(a, rows, t0, trace_rows, timing, env, planner)
    (a.out / "autoscale.json").write_text(json.dumps(s, indent=2) + "\n")
    fig = plot(a, rows, t0, trace_rows)
    print(report(s))
    print(f"figure: {fig}\nsummary: {a.out / 'autoscale.json'}")
    return 0 if s["requests"]["failed"] == 0 and s["requests"]["not_completed"] == 0 else 1


def write_report(a: argparse.Namespace) -> int:
    """--report-only: the analysis and figure again from a finished run folder."""
    old = json.loads((a.out / "autoscale.json").read_text())
    rows = load_records(a.out / "decisions.jsonl")
    t0 = rows[0]["ts"] - rows[0]["t"]
    trace_rows = load_records(a.out / "trace.jsonl")
    return finish(a, rows, t0, trace_rows, {**old["timing"], "loadtest_cmd": old.get("loadtest_cmd")}, old["env"],
                  old["planner"])


if __name__ == "__main__":
    sys.exit(main())
