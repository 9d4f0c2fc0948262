"""What batch invariance costs a burst, in process (not a server figure): the panel kernel at every
row count (the default where it is taken: AVX-512 without AMX) against the kernel choice before it,
the panel kernel up to 128 rows and oneDNN's packed GEMM above (restored here by making the panel
kernel decline larger calls). One engine; the variants take turns (moebus.loadtest.ab.alternate).

    python loadtest/ab_batch_invariance.py [--concurrency 16 64] [--rounds 3] [--dtype bfloat16]

Each round sends N random 128-token prompts (N = the concurrency) for 128 greedy tokens each, all at
once (bench_peers.engine_burst); prints the median tok/s and TTFT of each variant and whether the
two gave the same tokens.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_peers import engine_burst  # noqa: E402

from moebus.engine.config import EngineConfig  # noqa: E402
from moebus.engine.llm_engine import LLMEngine  # noqa: E402
from moebus.engine.sampling import SamplingParams  # noqa: E402
from moebus.kernels import panel_linear  # noqa: E402
from moebus.loadtest.ab import alternate  # noqa: E402

DECODE_SIZES = 128  # the panel kernel's largest call before it took every row count


class _KernelChoice:
    """Switches PanelLinear between every row count and decode sizes only (the old choice)."""

    def __init__(self) -> None:
        self.real = panel_linear.PanelLinear.__call__
        self.every_size = True
        choice = self

        def call(panel, x):
            return choice.real(panel, x) if choice.every_size or x.shape[0] <= DECODE_SIZES else None
        panel_linear.PanelLinear.__call__ = call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    choice = _KernelChoice()
    eng = LLMEngine(EngineConfig(dtype=args.dtype, enable_prefix_caching=False))
    rng = random.Random(0)
    vocab = eng.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for c in args.concurrency:
        prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(c)]
        stats: dict[str, list[dict]] = {"every row count": [], "decode sizes only": []}

        def run(name: str, every: bool, stats=stats, prompts=prompts, c=c) -> None:  # this round's
            choice.every_size = every
            stats[name].append(engine_burst(eng, prompts, c, params))

        alternate({"every row count": lambda: run("every row count", True),
                   "decode sizes only": lambda: run("decode sizes only", False)}, args.rounds, warmup=1)
        for name, runs in stats.items():
            toks = sorted(r["tok_s"] for r in runs[1:])
            ttft = sorted(r["ttft_ms"] for r in runs[1:])
            print(f"c={c} {name:18s} tok/s median {toks[len(toks) // 2]:7.1f} (spread {toks[0]:.1f}-{toks[-1]:.1f})"
                  f"  TTFT p50 median {ttft[len(ttft) // 2]:7.1f} ms")


if __name__ == "__main__":
    main()
