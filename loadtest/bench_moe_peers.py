"""An MoE checkpoint of real shape served by moebus, vLLM's CPU build and llama.cpp's native
llama-server, measured by one client: `vllm bench serve` (loadtest/peers/vllm_bench.py), random
128-token prompts, 128 output tokens, greedy, ignore EOS, at each concurrency.

Per round, every server in turn (the order rotates each round) starts fresh, answers one warm-up
request, is measured at every concurrency, and stops (peer_bench.py: the servers' command lines,
the client and how its figures are computed, the table). Same weights everywhere: moebus and vLLM
read the HF directory (bf16 safetensors), llama-server the bf16 GGUF llama.cpp's converter wrote
from it (loadtest/moe_checkpoint.py writes both). Threads: --threads (default: the host's cores)
for every server. Results: one JSON per run under --out (default ~/.cache/moebus/bench-moe,
outside the repository), each server's exact command line, and a table of medians with min-max
spread.

    .venv/bin/python loadtest/bench_moe_peers.py --model /work/peers/granite-moe --rounds 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_bench as pb  # noqa: E402  (loadtest/, beside this script)

NAME = "moe"  # served model name on every server
PROMPT, OUTPUT = 128, 128


def server_spec(server: str, model: Path, gguf: Path, threads: int, max_seqs: int, extra: list[str]) -> pb.ServerSpec:
    port = pb.PORTS[server]
    if server == "moebus":
        return pb.moebus_spec("moebus", port, threads, ["--model", str(model), "--served-model-name", NAME,
                                                       "--dtype", "bfloat16", *extra])
    if server == "vllm":  # a 4 GiB KV cache, 4096 tokens a sequence
        return pb.vllm_spec(port, model, NAME, "bfloat16", threads, 4, 4096, max_seqs, extra)
    # one slot per concurrent stream, each 320 tokens of context (128 in + 128 out + slack)
    return pb.llama_server_spec(port, gguf, NAME, threads, max_seqs, 320, extra)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="HF checkpoint directory")
    ap.add_argument("--gguf", type=Path, default=None, help="default: MODEL.bf16.gguf")
    ap.add_argument("--servers", default="moebus,vllm,llamacpp")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="every server's threads (default: the host's cores)")
    ap.add_argument("--prompts-per-stream", type=float, default=1.0, help="requests = max(8, this * c)")
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "moebus" / "bench-moe")
    ap.add_argument("--moebus-args", default="", help="extra `moebus up` flags, space separated")
    args = ap.parse_args(argv)
    from moebus.platforms.cpu.cores import usable_cores

    threads = args.threads or usable_cores()
    gguf = args.gguf or args.model.with_suffix(".bf16.gguf")
    servers = args.servers.split(",")
    levels = [pb.Level(PROMPT, OUTPUT, c, max(8, int(args.prompts_per_stream * c)))
              for c in (int(x) for x in args.concurrency.split(","))]
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    runs: list[pb.Run] = []
    shown: dict[str, str] = {}
    for rnd in range(1, args.rounds + 1):
        for server in pb.rotated(servers, rnd):
            extra = args.moebus_args.split() if server == "moebus" else []
            spec = server_spec(server, args.model, gguf, threads, max(lv.concurrency for lv in levels), extra)
            shown[server] = spec.shown()
            try:
                with pb.serving(spec, out / f"{server}-r{rnd}.log", NAME):
                    pb.warm(spec.url, NAME, args.model, PROMPT, out / f"{server}-r{rnd}-warm.json")
                    for lv in levels:
                        load, path = os.getloadavg()[0], out / f"{server}-c{lv.concurrency}-r{rnd}.json"
                        # each level its own prompts (no prefix-cache hits across levels)
                        res = pb.run_bench(spec.url, NAME, args.model, lv, 1000 * rnd + lv.concurrency, path)
                        runs.append(run := pb.run_of(res, server, rnd, lv, load, str(path)))
                        print(f"round {rnd} {server:8s} c={lv.concurrency:3d}: {run.tok_s:7.1f} tok/s  "
                              f"TPOT p50 {run.tpot_ms:7.1f} ms  TTFT p50 {run.ttft_ms:8.1f} ms  "
                              f"ok {run.ok}/{run.requests}  load {load:.2f}", flush=True)
            except (pb.ServerFailed, subprocess.CalledProcessError) as e:  # the others' runs go on
                print(f"round {rnd} {server}: {e}", flush=True)
    print("\nservers:\n" + pb.commands(shown))
    print(f"\n{PROMPT}/{OUTPUT} tokens, greedy, ignore EOS, {threads} threads per server; medians over "
          f"{args.rounds} rounds (min-max):")
    print(pb.table(runs))
    (out / "summary.json").write_text(json.dumps(
        {"servers": shown, "runs": [dataclasses.asdict(r) for r in runs]}, indent=1, default=str))
    print(f"results in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
