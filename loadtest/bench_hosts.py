"""What a host boundary costs (issue #40 item 3): the same services, one host against two.

    python loadtest/bench_hosts.py --rounds 2

Every service is `moebus serve` with its NATS node on its own host (network namespaces joined by a
router namespace: moebus/services/netns.py, host_stack.py); the real model (SmolLM2, dtype and
weight format auto as `moebus up` has them), one worker with both cores.
- tokens: tokenizer, balancer and frontend on host a; the worker on host a (`one-host`: one NATS
  node, the loopback path) or on host b (`two-hosts`: every request and every token crosses a route
  between two nodes and the veth links). `vllm bench serve` on host a: random 128 in / 128 out,
  greedy, ignore EOS, at c=1 and c=16; fresh stacks, order rotated each round, one warm-up request.
- KV: disaggregated, the prefill and decode workers on host b (`kv-one-host`) or on b and c
  (`kv-two-hosts`); prompts of --kv-prompt-len tokens one at a time; the prefill worker's
  `moebus_worker_kv_transfer_bytes_total` / `kv_transfer_seconds_sum` (send: its push of a request's
  KV, paced by the decode worker's credit grants, to the last grant) and the requests' TTFT.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_bench as pb  # noqa: E402  (loadtest/, beside this script)

from moebus.services.balancer.config import BalancerConfig  # noqa: E402
from moebus.services.frontend.config import FrontendConfig  # noqa: E402
from moebus.services.host_stack import HostStack, Process  # noqa: E402
from moebus.services.tokenizer.config import TokenizerConfig  # noqa: E402
from moebus.services.worker.config import WorkerConfig  # noqa: E402

HF_DIR = pb.PEERS / "smollm2-hf"  # the client's tokenizer
MODEL = "smollm2"
PORT = 8000
ENGINE = {"dtype": "auto", "weight_format": "auto"}  # what `moebus up` picks (EngineConfig's own: float32 dense)


def placement(name: str) -> tuple[tuple[str, ...], list[Process]]:
    """Hosts and processes of one placement."""
    front = [Process("a", "tokenizer", TokenizerConfig(instance_id="tokenizer-a", model=MODEL)),
             Process("a", "frontend", FrontendConfig(instance_id="frontend-a", port=PORT, models=[MODEL]))]
    if name in ("one-host", "two-hosts"):
        host = "a" if name == "one-host" else "b"
        return (("a",) if name == "one-host" else ("a", "b")), [
            *front, Process("a", "balancer", BalancerConfig(instance_id="balancer-a")),
            Process(host, "worker", WorkerConfig(instance_id=f"worker-{host}", model=MODEL, engine=ENGINE,
                                                 torch_threads=2))]
    decode_host = "b" if name == "kv-one-host" else "c"
    worker = {"model": MODEL, "engine": ENGINE, "torch_threads": 1}
    return (("a", "b") if name == "kv-one-host" else ("a", "b", "c")), [
        *front, Process("a", "balancer", BalancerConfig(instance_id="balancer-a", mode="disaggregated")),
        Process("b", "worker", WorkerConfig(instance_id="prefill-b", role="prefill", **worker)),
        Process(decode_host, "worker", WorkerConfig(instance_id=f"decode-{decode_host}", role="decode", **worker))]


def client(stack: HostStack, level: pb.Level, seed: int, out: Path) -> dict:
    """`vllm bench serve` from host a."""
    cmd = ["ip", "netns", "exec", stack.net.ns("a"),
           *pb.bench_cmd(stack.frontend_url("frontend-a"), MODEL, HF_DIR, level, seed, out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "wb") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=pb.REPO,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-prompt-len", type=int, default=1024)
    ap.add_argument("--kv-requests", type=int, default=8)
    ap.add_argument("--skip-tokens", action="store_true")
    ap.add_argument("--skip-kv", action="store_true")
    ap.add_argument("--out", default=None, help="folder for the client's JSON (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-hosts-"))
    levels = [pb.Level(args.prompt_len, args.output_len, c, max(12, 3 * c)) for c in map(int, args.concurrency.split(","))]
    kv_level = pb.Level(args.kv_prompt_len, 8, 1, args.kv_requests)
    runs: list[pb.Run] = []
    kv_rows: dict[str, list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        names = ([] if args.skip_tokens else ["one-host", "two-hosts"]) + ([] if args.skip_kv else
                                                                         ["kv-one-host", "kv-two-hosts"])
        for name in pb.rotated(names, rnd):
            hosts, procs = placement(name)
            with HostStack(hosts, procs, str(out / f"logs-{name}-{rnd}"), ready_timeout_s=300) as stack:
                base = out / name / f"r{rnd}"
                client(stack, pb.Level(args.prompt_len, 16, 1, 1), 999_999, base / "warm.json")
                if name.startswith("kv"):
                    b0 = stack.metric("prefill-b", "moebus_worker_kv_transfer_bytes_total", 'direction="send"')
                    s0 = stack.metric("prefill-b", "moebus_worker_kv_transfer_seconds_sum", 'direction="send"')
                    res = client(stack, kv_level, rnd, base / "kv.json")
                    b1 = stack.metric("prefill-b", "moebus_worker_kv_transfer_bytes_total", 'direction="send"')
                    s1 = stack.metric("prefill-b", "moebus_worker_kv_transfer_seconds_sum", 'direction="send"')
                    rate = (b1 - b0) / (s1 - s0) / 1e6 if s1 > s0 else float("nan")
                    kv_rows.setdefault(name, []).append((rate, res["median_ttft_ms"]))
                    print(f"round {rnd} {name}: {(b1 - b0) / 1e6:.1f} MB in {s1 - s0:.3f} s: {rate:.0f} MB/s; "
                          f"TTFT p50 {res['median_ttft_ms']:.0f} ms", flush=True)
                    continue
                for level in levels:
                    load = float(Path("/proc/loadavg").read_text().split()[0])
                    res = client(stack, level, rnd, base / f"{level.key}.json")
                    run = pb.run_of(res, name, rnd, level, load)
                    runs.append(run)
                    print(f"round {rnd} {name} c={level.concurrency}: {run.tok_s:.1f} tok/s, TTFT p50 "
                          f"{run.ttft_ms:.1f} ms, TPOT p50 {run.tpot_ms:.2f} ms ({run.ok}/{run.requests} ok)",
                          flush=True)
                time.sleep(1)
    if runs:
        print(pb.table(runs, ref="one-host"))
    for name, rows in kv_rows.items():
        print(f"{name}: KV send {statistics.median(r for r, _ in rows):.0f} MB/s "
              f"({min(r for r, _ in rows):.0f}-{max(r for r, _ in rows):.0f}), TTFT p50 "
              f"{statistics.median(t for _, t in rows):.0f} ms over {len(rows)} rounds")
    print(f"client JSON and logs: {out}")


if __name__ == "__main__":
    main()
