"""Where a decode step's time goes at batch B (issue 21, target 2), and the GEMM ceiling.

    python loadtest/profile_decode.py --batch 16 64          # per-component CPU time of decode steps
    python loadtest/profile_decode.py --ceiling               # packed fp32 GEMM GFLOP/s at M=16/64, read GB/s
                                                              # (median [fastest-slowest] of 20 alternating calls)

Times are `time.process_time` with torch on --threads (default 1): on a box loaded by other
processes the fraction of the step per component is robust even when absolute times are not.
Components are timed by wrapping the llama model's kernel entry points, PackedLinear.forward and the
runner's prepare/execute for the run (SmolLM2-135M, --dtype, greedy, --prompt-len tokens each).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time

import torch

from moebus.loadtest.ab import alternate


@contextlib.contextmanager
def _timed(acc: collections.Counter, targets: list[tuple[object, str, str]]):
    """Wrap each (owner, attribute, label) callable to add its process time to acc[label]; undone on exit."""
    saved = []
    for owner, name, label in targets:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def wrapped(*a, _f=f, _label=label, **k):
            t = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                acc[_label] += time.process_time() - t
        setattr(owner, name, functools.wraps(f)(wrapped))
    try:
        yield
    finally:
        for owner, name, f in reversed(saved):
            setattr(owner, name, f)


def profile(batch: int, steps: int, prompt_len: int, dtype: str = "float32") -> None:
    import moebus.engine.models.llama as llama
    import moebus.platforms.cpu.packed_linear as cl
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    kernels = ["apply_rotary_", "attend", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_cos_sin"]
    eng = LLMEngine(EngineConfig(model="smollm2", dtype=dtype, max_num_seqs=max(batch, 1),
                                 max_num_batched_tokens=4096))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, min_tokens=steps + 16, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i, p in enumerate(torch.randint(100, 49000, (batch, prompt_len), generator=g).tolist()):
        eng.add_request(f"p{i}", p, params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled (however the scheduler splits them) ...
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    for _ in range(2):  # ... then a few decode steps
        eng.step()
    acc: collections.Counter = collections.Counter()
    orig_linear = cl.PackedLinear.forward

    def linear(self, x):
        t = time.process_time()
        out = orig_linear(self, x)
        acc[f"linear {self.in_features}->{self.out_features}"] += time.process_time() - t
        return out

    runner = type(eng.runner)
    head = [(eng.runner, "greedy_head", "greedy head (fused head + argmax)")] if eng.runner.greedy_head else []
    targets = ([(llama, k, k) for k in kernels] + head
               + [(runner, "prepare", "runner.prepare"), (runner, "execute", "runner.execute")])
    cl.PackedLinear.forward = linear
    try:
        with _timed(acc, targets):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                eng.step()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        cl.PackedLinear.forward = orig_linear
        eng.close()
    print(f"\n{dtype} batch={batch} steps={steps} torch_threads={torch.get_num_threads()}: cpu {1e3 * cpu / steps:.1f} ms/step, "
          f"wall {1e3 * wall / steps:.1f} ms/step -> {batch * steps / cpu:.1f} tok/s per cpu-second")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        if k != "runner.execute":
            print(f"  {k:32s} {1e3 * v / steps:8.2f} ms/step {100 * v / cpu:6.1f}%")
    timed = sum(v for k, v in acc.items() if k not in ("runner.execute", "runner.prepare"))
    rest = acc["runner.execute"] - timed
    host = cpu - acc["runner.execute"] - acc["runner.prepare"]
    lin = sum(v for k, v in acc.items() if k.startswith("linear"))
    print(f"  {'execute, untimed (embed, index)':32s} {1e3 * rest / steps:8.2f} ms/step {100 * rest / cpu:6.1f}%")
    print(f"  {'step outside prepare+execute':32s} {1e3 * host / steps:8.2f} ms/step {100 * host / cpu:6.1f}%")
    print(f"  layer GEMMs together: {100 * lin / cpu:.1f}%")


def ceiling(repeat: int = 20) -> None:
    """Each GEMM shape of a step (and the LM head) timed alone, the shapes alternating (moebus.loadtest.ab)."""
    from moebus.platforms.cpu.packed_linear import _packed

    layer = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2: qkv, o, gate_up, down
    per_step = {shape: 30 for shape in layer} | {(576, 49152): 1}  # 30 layers, one LM head
    for m in (16, 64):
        calls = {}
        for k, n in per_step:
            lin = _packed(torch.nn.Parameter(torch.randn(n, k) * 0.02, requires_grad=False), None, 64)
            calls[(k, n)] = functools.partial(lin, torch.randn(m, k))
        with torch.inference_mode():
            timed = alternate(calls, repeat, warmup=1, clock=time.process_time)
        total_flop = total_s = 0.0
        for (k, n), times in per_step.items():
            s, (lo, hi) = timed[(k, n)].median, timed[(k, n)].spread
            total_flop += 2 * m * k * n * times
            total_s += s * times
            print(f"M={m:3d} {k:5d}->{n:6d}: {1e3 * s:8.3f} ms [{1e3 * lo:.3f}-{1e3 * hi:.3f}] "
                  f"{2 * m * k * n / s / 1e9:6.1f} GFLOP/s")
        print(f"M={m:3d} one step's GEMMs (30 layers + LM head): {1e3 * total_s:.1f} ms, "
              f"{total_flop / total_s / 1e9:.1f} GFLOP/s -> GEMM-only bound {m / total_s:.0f} tok/s per core")
    a = torch.randn(64 << 20)
    s = alternate({"sum": a.sum}, 5, warmup=1, clock=time.process_time)["sum"].median
    print(f"read bandwidth (sum of {a.numel() * 4 >> 20} MB): {a.numel() * 4 / s / 1e9:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", nargs="*", default=["float32"], help="float32 / bfloat16 / auto, each profiled")
    ap.add_argument("--ceiling", action="store_true", help="only the GEMM / bandwidth ceilings")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ceiling:
        ceiling()
        return
    for dtype in args.dtype:
        for b in args.batch:
            profile(b, args.steps, args.prompt_len, dtype)


if __name__ == "__main__":
    main()
