"""TTFT p50 vs tok/s for per-step token budgets, one in-process engine, paired (issue 21, target 2).

A burst of --concurrency requests sent at once (bench_peers' prompts: exactly --prompt-len tokens,
new random text per request, greedy, ignore_eos) waits on its prefill: a step budget of 2048 puts 16
x 128 prompt tokens into one step, so every first token waits for the whole step. Smaller steps let
the first requests' first tokens out after part of the work. Every round runs each setting in turn
(order rotated) on the same engine, so the settings see the same load; medians (min-max) over rounds.
A setting is "B" (max_num_batched_tokens B, no burst budget) or "B/P" (B, and a step budget of P
while prompts compete: burst_step_tokens P). --long times one lone long prompt's prefill
(max_tokens 1) per setting: what a small budget costs a request that has the machine to itself.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/sweep_step_budget.py --budgets 2048,1536,2048/1536
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import MODEL, engine_burst, make_prompts  # noqa: E402


def apply(eng, setting: str) -> None:
    """Set the engine's scheduler budgets in place (the model runner does not size by them)."""
    step, _, prefill = setting.partition("/")
    eng.scheduler.config.max_num_batched_tokens = int(step)
    eng.scheduler.config.burst_step_tokens = int(prefill) if prefill else None


def lone_prefill_ms(eng, prompt: list[int], params) -> float:
    eng.add_request(f"long{time.perf_counter_ns()}", prompt, params)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="2048,1536,2048/1536", help="settings: B or B/P (see above)")
    ap.add_argument("--concurrency", default="16,64", help="burst sizes (requests sent at once)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long", type=int, default=0, help="also time one lone prompt of this many tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    settings = args.budgets.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    eng = LLMEngine(EngineConfig(model=MODEL, dtype=args.dtype,
                                 max_num_batched_tokens=max(int(s.split("/")[0]) for s in settings)))
    out = args.output_len
    params = SamplingParams(temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    longs_ids = make_prompts((args.rounds + 1) * len(settings), args.long, "long")[1] if args.long else None
    # new prompts every run (no prefix-cache hits): one set per (round, setting, c), warm-up round 0
    n_sets = (args.rounds + 1) * len(settings)
    prompts = {c: make_prompts(c * n_sets, args.prompt_len, f"sweep{c}")[1] for c in concs}
    rows: dict[tuple[str, int], list[dict]] = {}
    longs: dict[str, list[float]] = {s: [] for s in settings}
    k = 0
    for rnd in range(args.rounds + 1):  # round 0 warms every shape up and is not counted
        order = settings[rnd % len(settings):] + settings[:rnd % len(settings)]
        for s in order:
            apply(eng, s)
            for c in concs:
                r = engine_burst(eng, prompts[c][k * c:(k + 1) * c], c, params)
                r["load"] = os.getloadavg()[0]
                if rnd:
                    rows.setdefault((s, c), []).append(r)
                print(f"round {rnd} {s:>9} c={c}: TTFT p50 {r['ttft_ms']:.0f} ms, {r['tok_s']:.1f} tok/s, "
                      f"TPOT {r['tpot_ms']:.1f} ms, load {r['load']:.2f}", flush=True)
            if longs_ids is not None:  # a new prompt each time: a prefix-cache hit would time nothing
                ms = lone_prefill_ms(eng, longs_ids[k], one)
                if rnd:
                    longs[s].append(ms)
                print(f"round {rnd} {s:>9} lone {args.long}-token prefill: {ms:.0f} ms", flush=True)
            k += 1

    def med(xs: list[float], fmt: str = "{:.0f}") -> str:
        return fmt.format(statistics.median(xs)) + f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    print(f"\n{args.rounds} rounds, {args.dtype}, {args.threads} threads, prompt {args.prompt_len} / output "
          f"{out}, greedy; medians (min-max); load avg now {os.getloadavg()}")
    print("| setting | c | TTFT p50 ms | tok/s | TPOT ms | load 1m |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for s in settings:
        for c in concs:
            rs = rows[(s, c)]
            loads = ", ".join(f"{r['load']:.1f}" for r in rs)
            print(f"| {s} | {c} | {med([r['ttft_ms'] for r in rs])} | {med([r['tok_s'] for r in rs], '{:.1f}')} | "
                  f"{med([r['tpot_ms'] for r in rs], '{:.1f}')} | {loads} |")
    if longs_ids is not None:
        for s in settings:
            print(f"lone {args.long}-token prefill at {s}: {med(longs[s])} ms")


if __name__ == "__main__":
    main()
