"""In process: an engine's decode ms/step at batch 1, 16 and 64 (128-token random prompts, greedy),
for one model file in one weight format and dtype: the figures BENCHMARKS.md's "An MoE on its
GGUF's blocks" compares (an in-process figure: never set beside a server's).

    .venv/bin/python loadtest/bench_moe_step.py /work/peers/granite-moe.q8_0.gguf --format gguf --dtype float32
    .venv/bin/python loadtest/bench_moe_step.py /work/peers/granite-moe --format dense --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--format", default="gguf", choices=["dense", "gguf"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a batch, after 8 untimed")
    args = ap.parse_args(argv)
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, weight_format=args.format, max_model_len=1024,
                                 num_kv_blocks=1200, max_num_seqs=64))
    g = torch.Generator().manual_seed(0)
    for b in (int(x) for x in args.batches.split(",")):
        for i in range(b):
            eng.add_request(f"r{b}-{i}", torch.randint(100, 49000, (128,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=8 + args.steps + 4, ignore_eos=True))
        for _ in range(8):
            eng.step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()
        times.sort()
        print(f"{args.format} {args.dtype} batch {b}: median {1000 * times[len(times) // 2]:.1f} ms/step "
              f"(min {1000 * times[0]:.1f}, max {1000 * times[-1]:.1f})", flush=True)


if __name__ == "__main__":
    main()
