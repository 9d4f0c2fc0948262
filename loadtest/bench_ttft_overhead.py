"""The stack's own share of the time to first token at c=1 (issue 21, target 3), per hop.

Starts `moebus up` (real processes: nats-server, frontend, tokenizer, balancer, worker, ...) with
its trace spans written to a file, sends --requests sequential streamed requests through the
`openai` SDK (moebus.loadtest.client.send), then cuts each request's TTFT into the hops of the
stack from the spans (moebus/loadtest/ttft_split.py): overhead = TTFT minus the engine step that
made the first token, so it does not depend on how fast the engine is. The toy model (default)
needs no weights; `--model smollm2` serves the real one.

Alternating A/B: `--tree base=/tmp/moebus-base --tree new=.` runs each tree's moebus (its
folder first on PYTHONPATH, this venv's packages) in turn, --rounds times, and prints each
tree's medians over all its requests with the spread (p10-p90) and the load average per run.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_ttft_overhead.py --requests 40 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's moebus.loadtest, whichever tree the stack runs

from floors import nats_round_trips, wait_listening  # noqa: E402  (loadtest/floors.py, beside this script)

from moebus.loadtest.client import RequestRecord, make_client, send  # noqa: E402
from moebus.loadtest.ttft_split import LEGS, OVERHEAD, STEP_PARTS, medians, quantile, split_all  # noqa: E402
from moebus.shared.nats_server import free_port  # noqa: E402
from moebus.shared.trace_view import read_spans  # noqa: E402

SPAN_FLUSH_S = 6.0  # the services' BatchSpanProcessor exports every 5 s


def start_stack(tree: Path, model: str, port: int, spans: Path | None, logs: Path,
                extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-c", "from moebus.cli import main; main()", "up", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--log-dir", str(logs), *extra]
    if spans is not None:
        args += ["--trace-file", str(spans)]
    return subprocess.Popen(args, cwd=tree, env=env, stdout=open(logs / "up.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, model: str, timeout_s: float = 600) -> None:
    """Until a completion answers (/v1/models can answer before a worker registers)."""
    body = json.dumps({"model": model, "prompt": "warm up", "max_tokens": 4}).encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moebus up exited ({proc.returncode})")
        try:
            req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


async def drive(url: str, model: str, n: int, prompt: str, output_len: int, chat: bool,
                gap_s: float) -> list[RequestRecord]:
    """n requests one after another (c=1), each with its own text (no cached prefix to lean on)."""
    client = make_client(url, timeout_s=600)
    t0, recs = time.perf_counter(), []
    for i in range(n):
        rec = RequestRecord(index=i, scheduled_s=0.0, input_tokens=0, output_tokens=output_len)
        text = f"{i}: {prompt}"
        if chat:
            recs.append(await send(client, model, rec, messages=[{"role": "user", "content": text}], t0=t0))
        else:
            recs.append(await send(client, model, rec, prompt=text, t0=t0))
        await asyncio.sleep(gap_s)  # the worker's after-request heartbeat and the spans' export settle
    await client.close()
    return recs


def run_floor(args: argparse.Namespace, rnd: int) -> dict:
    """The same client and requests against a bare aiohttp SSE server (loadtest/floors.py)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "loadtest" / "floors.py"), "sse", str(port)], cwd=REPO,
                            start_new_session=True)
    try:
        wait_listening(port)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(drive(url, args.model, args.warmup, args.prompt, args.output_len, True, args.gap))
        load = os.getloadavg()
        recs = asyncio.run(drive(url, args.model, args.requests, args.prompt, args.output_len, True, args.gap))
    finally:
        stop(proc)
    ttft = [1000 * r.ttft_s for r in recs if r.ok and r.ttft_s is not None]
    print(f"   floor round {rnd}: {len(ttft)}/{len(recs)} ok, TTFT p50 {statistics.median(ttft):.1f} ms "
          f"(client + bare HTTP), load {load[0]:.2f}", flush=True)
    return {"tree": "floor", "round": rnd, "ttft_ms": ttft, "load": [load[0], os.getloadavg()[0]]}


def run_once(name: str, tree: Path, args: argparse.Namespace, out: Path, rnd: int) -> dict:
    run_dir = out / f"{name}-{rnd}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spans, port = run_dir / "spans.jsonl", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_stack(tree, args.model, port, spans if args.trace else None, run_dir / "logs", args.up_args.split())
    try:
        wait_ready(proc, url, args.model)
        asyncio.run(drive(url, args.model, args.warmup, args.prompt, args.output_len, args.chat, args.gap))
        load_before = os.getloadavg()
        recs = asyncio.run(drive(url, args.model, args.requests, args.prompt, args.output_len, args.chat, args.gap))
        load_after = os.getloadavg()
        time.sleep(SPAN_FLUSH_S if args.trace else 0)
    finally:
        stop(proc)
    legs = split_all(read_spans(str(spans)), recs) if args.trace else []
    ok = sum(r.ok for r in recs)
    res = {"tree": name, "round": rnd, "ok": ok, "requests": len(recs), "split": len(legs), "legs": legs,
           "ttft_ms": [1000 * r.ttft_s for r in recs if r.ok and r.ttft_s is not None],
           "load": [load_before[0], load_after[0]], "errors": sorted({r.error or "" for r in recs if not r.ok})}
    (run_dir / "result.json").write_text(json.dumps(res, indent=1))
    m = medians(legs)
    print(f"   {name} round {rnd}: {ok}/{len(recs)} ok, {len(legs)} split, TTFT p50 "
          f"{statistics.median(res['ttft_ms']) if res['ttft_ms'] else float('nan'):.1f} ms, overhead p50 "
          f"{m.get(OVERHEAD, float('nan')):.1f} ms, load {load_before[0]:.2f} -> {load_after[0]:.2f}"
          + (f", errors {res['errors']}" if res["errors"] else ""), flush=True)
    return res


def report(results: list[dict], names: list[str]) -> str:
    cols = [*LEGS, *STEP_PARTS, OVERHEAD, "ttft"]
    lines = ["| leg (ms, median [p10-p90]) | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    per: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cols} for n in names}
    for r in results:
        for leg in r["legs"]:
            for k in (*LEGS, *STEP_PARTS, OVERHEAD):
                if k in leg:
                    per[r["tree"]][k].append(leg[k])
        per[r["tree"]]["ttft"] += r["ttft_ms"]
    for c in cols:
        cells = []
        for n in names:
            xs = per[n][c]
            cells.append(f"{statistics.median(xs):.2f} [{quantile(xs, 0.1):.2f}-{quantile(xs, 0.9):.2f}]" if xs else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for n in names:
        rs = [r for r in results if r["tree"] == n]
        rounds = ", ".join(f"{medians(r['legs']).get(OVERHEAD, float('nan')):.1f}" for r in rs)
        loads = ", ".join(f"{r['load'][0]:.1f}-{r['load'][1]:.1f}" for r in rs)
        lines.append(f"\n{n}: overhead p50 per round {rounds} ms; load avg 1m per round {loads}; "
                     f"requests split {sum(r['split'] for r in rs)}/{sum(r['requests'] for r in rs)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="toy", help="toy (no weights) or smollm2")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a moebus source tree to run (repeat: alternated); default: this one")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=30, help="measured requests per round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--prompt", default="Tell me about the quick brown fox and the lazy dog.")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                    help="chat completions (default) or text completions")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between requests")
    ap.add_argument("--up-args", default="", help="more `moebus up` flags, one string")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-trace: no spans, so no split; the TTFT alone (what tracing itself costs)")
    ap.add_argument("--out", default=None, help="a folder for spans, logs and results (default: a temp dir)")
    ap.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                    help="each round, the same client against a bare aiohttp SSE server: the client + HTTP floor")
    args = ap.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", REPO)]
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-ttft-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}, {'chat' if args.chat else 'text'} completions, {args.requests} requests x "
          f"{args.rounds} rounds per tree, output {args.output_len} tokens, up args {args.up_args!r}; "
          f"{os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    results: list[dict] = []
    floors: list[dict] = []
    for rnd in range(1, args.rounds + 1):
        order = trees if rnd % 2 else trees[::-1]
        for name, tree in order:
            results.append(run_once(name, tree, args, out, rnd))
        if args.floor:
            floors.append(run_floor(args, rnd))
    (out / "results.json").write_text(json.dumps(results + floors))
    print("\n" + report(results, [n for n, _ in trees]))
    if floors:
        xs = [x for f in floors for x in f["ttft_ms"]]
        print(f"\nfloor (the same client against a bare aiohttp SSE server, no stack): TTFT p50 "
              f"{statistics.median(xs):.2f} [{quantile(xs, 0.1):.2f}-{quantile(xs, 0.9):.2f}] ms; load avg 1m "
              + ", ".join(f"{f['load'][0]:.1f}" for f in floors))
    if args.floor:
        load, xs = os.getloadavg()[0], nats_round_trips(args.requests)
        print(f"bus floor (raw nats-py request/reply between two processes; a first token crosses the bus 3 "
              f"times one way: to the balancer, to the worker, the chunk back; 5 when the tokenizer service renders "
              f"(there and back too)): p50 {statistics.median(xs):.2f} [{quantile(xs, 0.1):.2f}-{quantile(xs, 0.9):.2f}] ms; "
              f"load avg 1m {load:.1f}")
    print(f"\nspans, logs, per-run JSON: {out}; load averages now: {os.getloadavg()}")


if __name__ == "__main__":
    main()
