"""Paired A/B of SmolLM2's four layer GEMM shapes: oneDNN on prepacked weights (PackedLinear's
call) vs plain F.linear, per row count (issue 21: where platforms/cpu/packed_linear.PACKED_MAX_ROWS caps packing).

    flock /tmp/moebus-bench.lock python loadtest/ab_packed_linear.py --dtype bfloat16 --rows 64 256 512 2048

One call per variant per round runs all four shapes (qkv 576->960, o 576->576, gate/up 576->3072,
down 1536->576) at the given row count; --rounds alternating rounds (moebus.loadtest.ab), wall
time on --threads torch threads; prints the medians, the spread, GFLOP/s and the rounds packed won.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from moebus.loadtest.ab import alternate, wins
from moebus.platforms.cpu.flags import cpu_flags, shown_flags

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="*", default=[64, 256, 512, 1024, 1536, 2048])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {' '.join(shown_flags(cpu_flags()))}; {args.dtype}, {args.threads} threads, {args.rounds} rounds")
    torch.manual_seed(0)
    weights = [torch.randn(o, i).to(dtype) for i, o in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]  # as PackedLinear packs
    print("| rows | packed ms | F.linear ms | packed GFLOP/s | F.linear GFLOP/s | packed faster |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in args.rows:
        xs = [torch.randn(m, i).to(dtype) for i, _ in SHAPES]
        rounds = alternate({
            "packed": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                     for x, p in zip(xs, packed, strict=True)],
            "plain": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
        }, args.rounds, warmup=2)
        gflop = sum(2 * m * i * o for i, o in SHAPES) / 1e9
        a, b = rounds["packed"], rounds["plain"]
        print(f"| {m} | {a.median * 1e3:.3f} ({a.spread[0] * 1e3:.3f}-{a.spread[1] * 1e3:.3f}) "
              f"| {b.median * 1e3:.3f} ({b.spread[0] * 1e3:.3f}-{b.spread[1] * 1e3:.3f}) "
              f"| {gflop / a.median:.0f} | {gflop / b.median:.0f} | {wins(a, b)}/{args.rounds} |")


if __name__ == "__main__":
    main()
