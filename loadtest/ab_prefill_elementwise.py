"""A/B of the CPU elementwise kernels (csrc/elementwise_cpu.c): this tree's build against the one
at an older commit (default: before the AVX-512 rows, c9ebb7f~1), alternating in one process.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/ab_prefill_elementwise.py --threads 1 2
    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/ab_prefill_elementwise.py --engine --threads 1

Per op: RMSNorm, fused add + RMSNorm, SiLU-and-mul and rotary at SmolLM2 shapes (`--rows` tokens,
hidden 576, intermediate 1536, 9/3 heads of 64) in bf16 and fp32, outputs preallocated, medians.
--engine: the whole prefill step (16 x 128-token prompts, one token out) with each build; the old
one's rotary returns new q/k tensors, as llama.py called it then. CPU time at --threads 1.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import moebus.engine.models.llama as llama
from moebus.kernels import cpu_build, rmsnorm, silu_mul
from moebus.kernels.rotary import _CPU_ARGTYPES as ROT_NEW
from moebus.kernels.rotary import _check, rotary_cos_sin
from moebus.loadtest.ab import alternate

NORM = [cpu_build.PTR, cpu_build.I64, cpu_build.PTR, cpu_build.I64, cpu_build.PTR, cpu_build.PTR, cpu_build.PTR,
        cpu_build.I64, cpu_build.I32, cpu_build.F32]
SILU = [cpu_build.PTR, cpu_build.I64, cpu_build.PTR, cpu_build.I64, cpu_build.I32, cpu_build.I32, cpu_build.F32]
ROT_OLD = [cpu_build.PTR, cpu_build.I64, cpu_build.I64, cpu_build.PTR, cpu_build.PTR, cpu_build.I64, cpu_build.PTR,
           cpu_build.I64, cpu_build.I32, cpu_build.I32, cpu_build.I32]  # no output strides yet


def build_old(rev: str, out: Path) -> cpu_build.CpuLibrary:
    """elementwise_cpu.c and its headers at `rev`, built with the usual flags."""
    for name in ("elementwise_cpu.c", "cpu_common.h"):
        src = subprocess.run(["git", "show", f"{rev}:moebus/kernels/csrc/{name}"], check=True, capture_output=True)
        (out / name).write_bytes(src.stdout)
    subprocess.run(["gcc", *cpu_build._FLAGS, "-o", str(out / "old.so"), str(out / "elementwise_cpu.c"), "-lm"],
                   check=True)
    handle = cpu_build.CpuLibrary("elementwise_cpu.c")
    handle._lib, handle._tried = ctypes.CDLL(str(out / "old.so")), True
    return handle


def op_calls(lib: cpu_build.CpuLibrary, old: bool, dt: torch.dtype, t: int) -> dict:
    es = torch.finfo(dt).bits // 8
    x, r, w = torch.randn(t, 576, dtype=dt), torch.randn(t, 576, dtype=dt), torch.randn(576, dtype=dt)
    o, ro = torch.empty_like(x), torch.empty_like(x)
    gu, so = torch.randn(t, 3072, dtype=dt), torch.empty(t, 1536, dtype=dt)
    qkv, qo, ko = torch.randn(t, 960, dtype=dt), torch.empty(t, 9, 64, dtype=dt), torch.empty(t, 3, 64, dtype=dt)
    cos, sin = rotary_cos_sin(torch.arange(t), 64, 1e4)
    norm, silu = lib.function("rms_norm", dt, NORM), lib.function("silu_mul", dt, SILU)
    rot = lib.function("rotary", dt, ROT_OLD if old else ROT_NEW)
    cs = (cos.data_ptr(), sin.data_ptr(), 32)

    def rotary() -> None:
        for off, heads, out in ((0, 9, qo), (576, 3, ko)):
            src = qkv.data_ptr() + off * es
            if old:  # into new tensors
                rot(src, 960, 64, *cs, out.data_ptr(), t, heads, 64, 32)
            else:  # in place on the qkv view
                rot(src, 960, 64, *cs, src, 960, 64, t, heads, 64, 32)

    return {"rms_norm": lambda: norm(x.data_ptr(), 576, None, 0, w.data_ptr(), o.data_ptr(), None, t, 576, 1e-5),
            "add_rms_norm": lambda: norm(x.data_ptr(), 576, r.data_ptr(), 576, w.data_ptr(), o.data_ptr(),
                                         ro.data_ptr(), t, 576, 1e-5),
            "silu_mul": lambda: silu(gu.data_ptr(), 3072, so.data_ptr(), t, 1536, 0, 0.0),
            "rotary": rotary}


def per_op(old_lib: cpu_build.CpuLibrary, args: argparse.Namespace) -> None:
    new_lib = cpu_build.library("elementwise_cpu.c")
    for dt in (torch.bfloat16, torch.float32):
        before, after = op_calls(old_lib, True, dt, args.rows), op_calls(new_lib, False, dt, args.rows)
        for nt in args.threads:
            torch.set_num_threads(nt)
            for name in before:
                res = alternate({"old": before[name], "new": after[name]}, args.rounds, warmup=2)
                a, b = res["old"].median * 1e3, res["new"].median * 1e3
                print(f"{str(dt)[6:]:8s} {nt} thr {name:12s} old {a:6.3f} ms  new {b:6.3f} ms  {a / b:4.2f}x  "
                      f"(x30 layers: {30 * a:5.1f} -> {30 * b:5.1f} ms)", flush=True)


def engine(old_lib: cpu_build.CpuLibrary, args: argparse.Namespace) -> None:
    from moebus.engine.llm import LLM
    from moebus.engine.sampling.params import SamplingParams

    def old_rotary(q, k, cos, sin):
        half, fn, outs = _check(q, k, cos, sin), old_lib.function("rotary", q.dtype, ROT_OLD), []
        for x in (q, k):
            out = torch.empty(x.shape, dtype=x.dtype)
            fn(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
               *x.shape, half)
            outs.append(out)
        return outs[0], outs[1]

    new = (rmsnorm.library, llama.apply_rotary_)

    def use(which: str) -> None:
        rmsnorm.library = silu_mul.library = (lambda source: old_lib) if which == "old" else new[0]
        llama.apply_rotary_ = old_rotary if which == "old" else new[1]

    torch.set_num_threads(args.threads[0])
    clock = time.process_time if args.threads[0] == 1 else time.perf_counter
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=2048, max_num_seqs=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.rounds + 1):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            use(name)
            t0 = clock()
            llm.generate(prompts, params)
            if r:  # round 0 warms up
                times[name].append(clock() - t0)
    use("new")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    wins = sum(b < a for a, b in zip(times["old"], times["new"], strict=True))
    print(f"{args.dtype} 16 x 128 prefill step, {args.threads[0]} thr ({'CPU' if clock is time.process_time else 'wall'}):"
          f" old {med['old']:.1f} ms, new {med['new']:.1f} ms ({med['old'] / med['new']:.2f}x), new faster "
          f"{wins}/{args.rounds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", default="c9ebb7f~1")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_lib = build_old(args.old_rev, Path(tmp))
        (engine if args.engine else per_op)(old_lib, args)
    print("loadavg", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
