"""What sampled decode steps cost over greedy ones, in process (issue 37 item 2).

    python loadtest/bench_sampler.py                          # bf16 and fp32, c=16 and 64
    python loadtest/bench_sampler.py --dtypes bfloat16 --batch 64 --rounds 12 --profile

One engine per (dtype, variant) with B requests decoding; variants: greedy, temperature 1,
temperature 1 with top_p 0.95, and that with penalties (repetition 1.1, frequency 0.3, presence
0.3). --steps decode steps per variant per round, variants alternating for --rounds rounds
(moebus.loadtest.ab); prints the median wall ms per step (fastest-slowest round), tok/s and the
ratio to greedy's tok/s. --profile adds where a sampled step's extra time goes (the Sampler's parts
on the step's real logits). In-process figures: compare within one run, never with a server's.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams
from moebus.loadtest.ab import alternate

_COMMON = dict(max_tokens=4096, ignore_eos=True)
VARIANTS = {
    "greedy": SamplingParams(temperature=0.0, **_COMMON),
    "T=1": SamplingParams(temperature=1.0, **_COMMON),
    "T=1 p0.95": SamplingParams(temperature=1.0, top_p=0.95, **_COMMON),
    "T=1 p0.95 penalties": SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1,
                                          frequency_penalty=0.3, presence_penalty=0.3, **_COMMON),
}


def _engine(dtype: str, b: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2", dtype=dtype, max_num_seqs=b, max_num_batched_tokens=4096))


def engine_ab(dtype: str, b: int, prompt_len: int, steps: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49000, (b, prompt_len), generator=g).tolist()
    engines = {}
    for name, params in VARIANTS.items():
        eng = engines[name] = _engine(dtype, b)
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}-{i}", p, params)
        for _ in range(4):  # prefill and a few decode steps
            eng.step()

    def decode(eng: LLMEngine) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                eng.step()
        return run

    timed = alternate({name: decode(eng) for name, eng in engines.items()}, rounds, warmup=1)
    for eng in engines.values():
        eng.close()
    base = timed["greedy"].median
    print(f"\n{dtype} c={b}: median wall ms per decode step over {rounds} rounds of {steps} steps, "
          f"variants alternating (in process)")
    for name, t in timed.items():
        ms, (lo, hi) = 1e3 * t.median / steps, t.spread
        print(f"  {name:22s} {ms:8.1f} ms [{1e3 * lo / steps:.1f}-{1e3 * hi / steps:.1f}]  {1e3 * b / ms:7.1f} tok/s"
              f"  {base / t.median:5.3f}x greedy's tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, loadavg {os.getloadavg()[0]:.2f}")
    for dtype in args.dtypes:
        for b in args.batch:
            engine_ab(dtype, b, args.prompt_len, args.steps, args.rounds)
    print(f"\nloadavg at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
