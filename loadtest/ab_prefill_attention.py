"""A/B of prefill attention on CPU: the C kernel (csrc/prefill_attention_cpu.c, one call per layer)
against the per-sequence SDPA path it replaced, alternating in one process, medians.

    python loadtest/ab_prefill_attention.py --dtype bfloat16 --prompts 16 --len 128 --rounds 7

Prints the whole-model prefill step (SmolLM2, `--prompts` random prompts of `--len` tokens in
one step, one generated token, prefix cache off) with each path, and in how many rounds the
kernel was faster. Wall time, or CPU time with --threads 1 (steadier on a busy machine); run it
under flock /tmp/moebus-bench.lock.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import moebus.engine.attention as attention
from moebus.engine.llm import LLM
from moebus.engine.sampling.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads; 1 times CPU time, not wall time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    tokens = args.prompts * args.len
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=max(2048, tokens),
              max_num_seqs=max(64, args.prompts))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    kernel = attention.prefill_attention_cpu
    paths = {"kernel": kernel, "sdpa": lambda *a, **k: None}  # None: attend's per-sequence loop
    times: dict[str, list[float]] = {k: [] for k in paths}
    firsts: dict[str, list[int]] = {}
    for r in range(args.rounds + 1):
        for name, fn in paths.items():
            attention.prefill_attention_cpu = fn
            t0 = clock()
            outs = llm.generate(prompts, params)
            if r:  # round 0 warms up
                times[name].append(clock() - t0)
            firsts[name] = [o.outputs[0].token_ids[0] for o in outs]
    attention.prefill_attention_cpu = kernel
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    wins = sum(a < b for a, b in zip(times["kernel"], times["sdpa"], strict=True))
    same = sum(a == b for a, b in zip(firsts["kernel"], firsts["sdpa"], strict=True))
    print(f"{args.dtype} {args.prompts} x {args.len} tokens, {torch.get_num_threads()} threads: "
          f"kernel {med['kernel']:.1f} ms, sdpa {med['sdpa']:.1f} ms ({med['sdpa'] / med['kernel']:.2f}x), "
          f"kernel faster in {wins}/{args.rounds} rounds; same first token for {same}/{args.prompts} prompts "
          f"({'CPU' if clock is time.process_time else 'wall'} time)")


if __name__ == "__main__":
    main()
