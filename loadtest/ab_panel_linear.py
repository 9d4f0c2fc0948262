"""oneDNN's packed GEMM vs the panel kernel (kernels/panel_linear.py) at decode row counts,
alternating in one process.

    python loadtest/ab_panel_linear.py --rows 1 8 16 64 128 [--dtype float32] [--rounds 7] [--threads 2] [--head]

One round calls SmolLM2's four layer shapes for each of --layers layers (default 30, distinct
weights: each is read from memory, as in a decode step, not from the last-level cache); --head adds
its 49152 x 576 LM head once a round. Prints the median ms a round, GFLOP/s, and in how many rounds
the panel kernel was faster; each arm's output is checked against float64 first.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.panel_linear import panel_linear_cpu

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # (out, in): gate+up, down, qkv, o
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--head", action="store_true")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, args.dtype)
    weights = [(torch.randn(s, generator=g) * 0.05).to(dt) for _ in range(args.layers) for s in SHAPES]
    if args.head:
        weights.append((torch.randn(HEAD, generator=g) * 0.05).to(dt))
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    panels = [pack_panels(w) for w in weights]
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).to(dt) for k in {w.shape[1] for w in weights}}

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> list[torch.Tensor]:
            return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(weights, onednn, strict=True)]

        def run_panels(xs: dict[int, torch.Tensor] = xs) -> list[torch.Tensor]:
            return [panel_linear_cpu(xs[w.shape[1]], p, *w.shape) for w, p in zip(weights, panels, strict=True)]

        arms = {"onednn": run_onednn, "panels": run_panels}
        for name, arm in arms.items():  # both right before timing: every output against float64
            for w, out in zip(weights[:len(SHAPES)], arm(), strict=False):
                ref = xs[w.shape[1]].double() @ w.double().T
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, f"{name}: {rows} rows x {tuple(w.shape)}: relative error {err:.1e}"
        times: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(args.rounds):
            for name in arms if r % 2 == 0 else reversed(arms):
                t0 = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t0)
        flop = 2 * rows * sum(w.numel() for w in weights)
        med = {k: statistics.median(v) for k, v in times.items()}
        wins = sum(p < o for o, p in zip(times["onednn"], times["panels"], strict=True))
        print(f"{rows:4d} rows: oneDNN {med['onednn'] * 1e3:7.2f} ms ({flop / med['onednn'] / 1e9:4.0f} GFLOP/s)  "
              f"panels {med['panels'] * 1e3:7.2f} ms ({flop / med['panels'] / 1e9:4.0f} GFLOP/s)  "
              f"{med['onednn'] / med['panels']:.2f}x, panels faster in {wins}/{args.rounds}", flush=True)


if __name__ == "__main__":
    main()
