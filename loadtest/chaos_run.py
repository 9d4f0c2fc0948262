"""Replay a trace through the whole stack while a worker is SIGKILLed every N seconds.

Each killed worker is restarted at once under the same id (as a supervisor would): the balancer
sees the new incarnation and the frontend moves the dead process's requests to live workers,
resuming their streams from the tokens already sent. Writes the load test's run folder plus
chaos.json (kills, frontend migrations, requests in flight at a kill vs the others) and prints
the comparison.

    .venv/bin/python loadtest/chaos_run.py --workers 3 --kill-every 20 --name chaos-kill20 -- \
        --trace ../shared/traces/azure_code_2023.csv --start 400 --duration 120 --length-scale 0.05 \
        --output-scale 1 --max-input-tokens 512 --max-output-tokens 32 --max-in-flight 32

Traffic goes only to 127.0.0.1; the run and the kill loop are bounded by the trace window.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from moebus.loadtest.cli import default_results_dir
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

RESULTS = default_results_dir()  # run folders stay out of the source tree, as `moebus loadtest run`'s


def _migrations(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {labels: float(v) for labels, v in
            re.findall(r"^moebus_frontend_migrations_total\{(.*)\} (\S+)$", text, re.M)}


def _chaos(stack: Stack, workers: list[str], every: float, stop: threading.Event, seed: int) -> list[dict]:
    rng, kills = random.Random(seed), []
    while not stop.wait(every):
        victim = rng.choice(workers)
        stack.kill(victim, signal.SIGKILL)
        stack.procs[victim].wait(10)
        kills.append({"unix": time.time(), "worker": victim})
        print(f"chaos: killed {victim}, restarting it", flush=True)
        stack.respawn(victim)
    return kills


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines() if line.strip()]


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between SIGKILLs (0: no faults)")
    ap.add_argument("--seed", type=int, default=0, help="which worker dies when")
    ap.add_argument("--name", required=True, help="run folder under default_results_dir() (~/.cache/moebus/loadtest)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--stack", default="{}", help='extra StackConfig fields as JSON, e.g. '
                    '\'{"frontend": {"max_worker_failures": 3}}\'')
    ap.add_argument("--baseline", default=None, help="a no-fault run folder of the same trace and --prompt-seed: "
                    "report each request's added E2E against it")
    ap.add_argument("loadtest_args", nargs=argparse.REMAINDER, help="after --: moebus loadtest run options")
    args = ap.parse_args()
    extra = [a for a in args.loadtest_args if a != "--"]
    out = RESULTS / args.name
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=args.model, workers=args.workers,
                      worker={"torch_threads": 1}, log_dir=f"/tmp/moebus-chaos-{args.name}", ready_timeout_s=600,
                      **json.loads(args.stack))
    with Stack(cfg) as stack:
        workers = [f"worker-{i}" for i in range(args.workers)]
        stop, kills = threading.Event(), []
        chaos = threading.Thread(target=lambda: kills.extend(_chaos(stack, workers, args.kill_every, stop, args.seed)),
                                 daemon=True)
        cmd = [sys.executable, "-m", "moebus.cli", "loadtest", "run", "--url", stack.url, "--out", str(out),
               "--no-progress", *extra]
        lt = subprocess.Popen(cmd)
        if args.kill_every > 0:
            chaos.start()
        rc = lt.wait()
        stop.set()
        if chaos.is_alive():
            chaos.join(30)
        migrated = _migrations(stack.url)
    records = _records(out)
    hit, calm = [], []
    for r in records:
        if r["e2e_s"] is None:
            continue
        end = r["sent_unix"] + r["e2e_s"]
        (hit if any(r["sent_unix"] <= k["unix"] <= end for k in kills) else calm).append(r)
    added = {}
    if args.baseline:  # the same request (index) in a run without faults
        base = {b["index"]: b["e2e_s"] for b in _records(Path(args.baseline)) if b["e2e_s"] is not None}
        for label, group in (("in_flight_at_a_kill", hit), ("others", calm)):
            d = sorted(r["e2e_s"] - base[r["index"]] for r in group if r["index"] in base)
            added[label] = {"p50_s": _p50(d), "p90_s": round(d[int(0.9 * (len(d) - 1))], 3) if d else None}
    ok = [r for r in records if r["status"] == 200 and r["error"] is None]
    report = {
        "workers": args.workers, "kill_every_s": args.kill_every, "stack": json.loads(args.stack), "kills": kills,
        "migrations": migrated,
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "in_flight_at_a_kill": {"n": len(hit), "e2e_p50_s": _p50([r["e2e_s"] for r in hit]),
                                "ttft_p50_s": _p50([r["ttft_s"] for r in hit if r["ttft_s"] is not None])},
        "others": {"n": len(calm), "e2e_p50_s": _p50([r["e2e_s"] for r in calm]),
                   "ttft_p50_s": _p50([r["ttft_s"] for r in calm if r["ttft_s"] is not None])},
        "errors": sorted({r["error"] for r in records if r["error"]}),
        "added_e2e_vs_baseline": added,
    }
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "kills"}, indent=2))
    print(f"kills: {len(kills)}; results: {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
