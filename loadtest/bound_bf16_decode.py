"""In process: what a batch-1 bf16 decode step of the Granite-3.0-1B-A400M shape spends in its weight
kernels alone, called as the module path calls them (kernels/panel_linear.py's PanelLinear for the
fused q|k|v and o, kernels/fused_moe.py's panel MoE for the top-8 of 32 experts, the head on
PanelLinear with float32 logits), seeded random bf16 weights (distinct for every layer: each step
reads them from memory, as a real step does), alternating with a streaming read of the same bytes
(torch's sum over them viewed as float32 words): which kernel keeps up with this machine's memory
and which does not (BENCHMARKS.md, "Where bf16 at c=1 goes").

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bound_bf16_decode.py --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moebus.kernels.fused_moe import ExpertPanels, fused_moe_panels_cpu
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.kernels.panel_linear import PanelLinear

LAYERS, HIDDEN, Q, KV, EXPERTS, TOP_K, INTER, VOCAB = 24, 1024, 1024, 512, 32, 8, 512, 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    layers = []
    for _ in range(LAYERS):
        qkv, o = w(Q + 2 * KV, HIDDEN), w(HIDDEN, Q)
        layers.append((PanelLinear(pack_panels(qkv), Q + 2 * KV, HIDDEN), PanelLinear(pack_panels(o), HIDDEN, Q),
                       ExpertPanels.pack(w(EXPERTS, 2 * INTER, HIDDEN), w(EXPERTS, HIDDEN, INTER))))
    head = PanelLinear(pack_panels(w(VOCAB, HIDDEN)), VOCAB, HIDDEN, float_out=True)
    step_bytes = 2 * (LAYERS * (HIDDEN * (Q + 2 * KV) + Q * HIDDEN + TOP_K * 3 * INTER * HIDDEN) + VOCAB * HIDDEN)
    flat = torch.empty(step_bytes // 2, dtype=torch.bfloat16).normal_(generator=g)
    x = torch.randn(1, HIDDEN, generator=g).bfloat16()
    ids = torch.randperm(EXPERTS, generator=g)[:TOP_K].view(1, TOP_K)
    tw = torch.full((1, TOP_K), 1.0 / TOP_K)

    def timed(f) -> float:
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3

    parts = {  # name -> (the calls, the bytes they read)
        "q|k|v and o": (lambda: [(qkv(x), o(x)) for qkv, o, _ in layers],
                        2 * LAYERS * (HIDDEN * (Q + 2 * KV) + Q * HIDDEN)),
        "experts (8 of 32)": (lambda: [fused_moe_panels_cpu(x, e, tw, ids, INTER) for _, _, e in layers],
                              2 * LAYERS * TOP_K * 3 * INTER * HIDDEN),
        "head": (lambda: head(x), 2 * VOCAB * HIDDEN),
        # the same bytes read by torch as float32 words: a plain streaming read on these cores
        "read (torch sum)": (lambda: flat.view(torch.float32).sum(), step_bytes),
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    for r in range(args.rounds + 1):
        for name, (f, _) in parts.items():
            t = timed(f)
            if r:  # the first round warms up
                times[name].append(t)
    total = 0.0
    for name, (_, nbytes) in parts.items():
        m = statistics.median(times[name])
        total += m if not name.startswith("read") else 0.0
        print(f"{name}: {m:.2f} ms ({min(times[name]):.2f}-{max(times[name]):.2f}) for {nbytes / 1e9:.3f} GB: "
              f"{nbytes / m / 1e6:.1f} GB/s")
    print(f"weight kernels in all: {total:.2f} ms for {step_bytes / 1e9:.3f} GB: {step_bytes / total / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
