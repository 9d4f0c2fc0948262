"""A/B of the CPU paged decode kernel (csrc/paged_attention_cpu.c): a git revision's source vs the
working tree's, both built with the project's flags and called alternately in one process.

    OMP_NUM_THREADS=1 python loadtest/ab_paged_decode.py --batch 64 --len 192 --rounds 11 [--rev HEAD~1] [--dtype bfloat16]

Prints median ms per call (time.process_time, one call per layer cache a round) and in how many
rounds the new build was faster; SmolLM2's heads (9 query, 3 kv, dim 64), block 16, scattered
blocks. --layers caches (default 30, as the model) are called in turn: the engine reads each
layer's KV from memory, where one cache called again stays in the last-level cache.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from moebus.kernels import cpu_build
from moebus.kernels import paged_attention as pa


def _build(source: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", *cpu_build._FLAGS, "-I", str(cpu_build._CSRC), "-o", str(out), str(src), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="git revision of the old source")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--len", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dt = getattr(torch, args.dtype)
    rel = "moebus/kernels/csrc/paged_attention_cpu.c"
    old_src = subprocess.run(["git", "show", f"{args.rev}:{rel}"], capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        fns = {}
        for tag, src in (("old", old_src), ("new", (cpu_build._CSRC / "paged_attention_cpu.c").read_text())):
            f = getattr(_build(src, Path(tmp) / f"pa_{tag}.so"), f"paged_decode_{cpu_build.DTYPE_SUFFIX[dt]}")
            f.argtypes, f.restype = pa._CPU_ARGTYPES, ctypes.c_int
            fns[tag] = f
        b, bs, n = args.batch, 16, args.len
        nb = -(-n // bs)
        caches = [(torch.randn(b * nb + 1, bs, 3, 64).to(dt), torch.randn(b * nb + 1, bs, 3, 64).to(dt))
                  for _ in range(args.layers)]
        bt = (torch.randperm(b * nb).view(b, nb) + 1).int()
        q, sl = torch.randn(b, 9, 64).to(dt), torch.full((b,), n, dtype=torch.int32)

        def call(fn, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            out = torch.empty(b, 9, 64, dtype=dt)
            status = fn(q.data_ptr(), q.stride(0), q.stride(1), kc.data_ptr(), *kc.stride()[:3], vc.data_ptr(),
                        *vc.stride()[:3], bt.data_ptr(), bt.stride(0), sl.data_ptr(), None, out.data_ptr(),
                        out.stride(0), out.stride(1), b, 9, 3, 64, 64, bs, 0, 0.125)
            assert status == 0
            return out

        diff = (call(fns["old"], *caches[0]).float() - call(fns["new"], *caches[0]).float()).abs().max().item()
        res: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for tag in ("old", "new") if r % 2 == 0 else ("new", "old"):
                t = time.process_time()
                for kc, vc in caches:
                    call(fns[tag], kc, vc)
                res[tag].append((time.process_time() - t) / len(caches) * 1e3)
    m = {k: statistics.median(v) for k, v in res.items()}
    wins = sum(n_ < o for o, n_ in zip(res["old"], res["new"], strict=True))
    print(f"{args.dtype} B={b} len={n} layers={args.layers}: {args.rev} {m['old']:.3f} ms, working tree {m['new']:.3f} ms, "
          f"speedup {m['old'] / m['new']:.2f}x, new faster in {wins}/{args.rounds} rounds, max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
