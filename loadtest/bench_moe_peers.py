"""An MoE checkpoint of real shape served by moebus, vLLM's CPU build and llama.cpp's native
llama-server, measured by one client: `vllm bench serve` (loadtest/peers/vllm_bench.py), random
128-token prompts, 128 output tokens, greedy, ignore EOS, at each concurrency.

Per round, every server in turn (the order rotates each round) starts fresh, answers one warm-up
request, is measured at every concurrency, and stops. Same weights everywhere: moebus and vLLM
read the HF directory (bf16 safetensors), llama-server the bf16 GGUF llama.cpp's converter wrote
from it (loadtest/moe_checkpoint.py writes both). Results: one JSON per run under --out (default
~/.cache/moebus/bench-moe, outside the repository) and a table of medians with min-max spread.

    .venv/bin/python loadtest/bench_moe_peers.py --model /work/peers/granite-moe --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from bench_ttft_overhead import stop, wait_ready  # noqa: E402  (loadtest/, beside this script)

PEERS = Path(os.environ.get("PEERS", "/work/peers"))
VLLM_PY = PEERS / "vllm-venv" / "bin" / "python"
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", PEERS / "llama-cpp-src" / "build" / "bin" / "llama-server"))
PORTS = {"moebus": 8401, "vllm": 8402, "llamacpp": 8403}
NAME = "moe"  # served model name on every server


def server_cmd(server: str, model: Path, gguf: Path, threads: int, max_seqs: int, extra: list[str]) -> tuple[list[str], dict]:
    port = str(PORTS[server])
    env = dict(os.environ)
    if server == "moebus":
        return [str(REPO / ".venv" / "bin" / "moebus"), "up", "--host", "127.0.0.1", "--port", port, "--model",
                str(model), "--served-model-name", NAME, "--dtype", "bfloat16", *extra], env
    if server == "vllm":
        env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        return [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", NAME, "--host", "127.0.0.1", "--port", port, "--dtype", "bfloat16",
                "--max-model-len", "4096", "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", "2048",
                *extra], env
    # llama-server: one slot per concurrent stream, each 320 tokens of context (128 in + 128 out + slack)
    return [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", port, "-a", NAME, "-t", str(threads),
            "-tb", str(threads), "-np", str(max_seqs), "-c", str(320 * max_seqs), "--no-webui", *extra], env


def bench(port: int, model: Path, concurrency: int, prompts: int, out: Path, seed: int) -> dict:
    cmd = [str(VLLM_PY), str(REPO / "loadtest" / "peers" / "vllm_bench.py"), "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", NAME,
           "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "128",
           "--random-output-len", "128", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _spread(runs: list[dict], key: str) -> str:
    v = [r[key] for r in runs]
    return f"{statistics.median(v):8.1f} ({min(v):.1f}-{max(v):.1f})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="HF checkpoint directory")
    ap.add_argument("--gguf", type=Path, default=None, help="default: MODEL.bf16.gguf")
    ap.add_argument("--servers", default="moebus,vllm,llamacpp")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-stream", type=float, default=1.0, help="requests = max(8, this * c)")
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "moebus" / "bench-moe")
    ap.add_argument("--moebus-args", default="", help="extra `moebus up` flags, space separated")
    args = ap.parse_args(argv)
    gguf = args.gguf or args.model.with_suffix(".bf16.gguf")
    servers, levels = args.servers.split(","), [int(c) for c in args.concurrency.split(",")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: dict[tuple[str, int], list[dict]] = {}
    for rnd in range(args.rounds):
        order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
        for server in order:
            extra = args.moebus_args.split() if server == "moebus" else []
            cmd, env = server_cmd(server, args.model, gguf, args.threads, max(levels), extra)
            log = (args.out / stamp / f"{server}-r{rnd}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as logf:
                proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                # until a completion answers (llama-server lists its model while still loading it)
                wait_ready(proc, f"http://127.0.0.1:{PORTS[server]}", NAME, timeout_s=900)
                for c in levels:
                    load = os.getloadavg()[0]
                    res = bench(PORTS[server], args.model, c, max(8, int(args.prompts_per_stream * c)),
                                args.out / stamp / f"{server}-c{c}-r{rnd}.json", seed=1000 * rnd + c)
                    res["load_before"] = load
                    rows.setdefault((server, c), []).append(res)
                    print(f"round {rnd} {server:8s} c={c:3d}: {res['output_throughput']:7.1f} tok/s  "
                          f"TPOT p50 {res['median_tpot_ms']:7.1f} ms  TTFT p50 {res['median_ttft_ms']:8.1f} ms  "
                          f"ok {res['completed']}/{res['num_prompts']}  load {load:.2f}", flush=True)
            finally:
                stop(proc)
            time.sleep(3)
    print("\nmedians over rounds (min-max):")
    print(f"{'server':8s} {'c':>3s} {'tok/s':>20s} {'TPOT p50 ms':>22s} {'TTFT p50 ms':>24s}")
    for (server, c), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{server:8s} {c:3d} {_spread(rs, 'output_throughput'):>20s} {_spread(rs, 'median_tpot_ms'):>22s} "
              f"{_spread(rs, 'median_ttft_ms'):>24s}")
    (args.out / stamp / "summary.json").write_text(json.dumps(
        {f"{s}-c{c}": rs for (s, c), rs in rows.items()}, indent=1, default=str))
    print(f"results in {args.out / stamp}", file=sys.stderr)


if __name__ == "__main__":
    main()
