"""A/B of the GGUF blocks' GEMM (kernels/qpanel.py: Q4_1 panels, 16-bit integer activations) against
the bf16 panel kernel (kernels/panel_linear.py) on SmolLM2's seven layer shapes x 30 layers, random
weights, alternating, medians of 5. What the default's blocks cost against dense bf16 at each row
count (BENCHMARKS.md, "A lone stream on the GGUF's blocks").

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/ab_qpanel_linear.py --rows 1 16 64 256 1024 2048
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from moebus.kernels.lm_head_argmax import pack_panels as pack_bf16
from moebus.kernels.panel_linear import PanelLinear
from moebus.kernels.qpanel import pack_panels, qpanel_matmul

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    layers = []
    for n, k in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        q = torch.from_numpy(quantize(w, GGMLQuantizationType.Q4_1).copy())
        layers.append((n, k, pack_panels(q, "Q4_1", k), PanelLinear(pack_bf16(torch.from_numpy(w).bfloat16()), n, k)))

    def run(rows: int, blocks: bool) -> float:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        xb = {k: v.bfloat16() for k, v in xs.items()}
        t = time.perf_counter()
        for _ in range(LAYERS):
            for n, k, panels, bf16 in layers:
                qpanel_matmul(xs[k], panels, "Q4_1", n) if blocks else bf16(xb[k])
        return (time.perf_counter() - t) * 1e3

    print("| rows | Q4_1 panels ms | bf16 panels ms | Q4_1 / bf16 |\n| ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for blocks in (True, False):
                times[blocks].append(run(rows, blocks))
        q, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {rows} | {q:.2f} | {b:.2f} | {q / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
