"""Paired A/B of the in-process engine's decode steps (issue 21, target 2): the greedy LM head's
auto C path (bf16: AMX where the CPU has it, else vdpbf16ps where it has AVX512-BF16; fp32: AVX-512
FMA tiles where built) vs another of its paths (--b-isa, default fma256: the AVX2 tiles all dtypes
took before; fma: the float32 tiles bf16 took without AMX before 2026-12-05; bf16-only paths leave
the fp32 pair at auto).

    flock /tmp/moebus-bench.lock python loadtest/ab_greedy_head.py --batch 16 64 --rounds 7 [--b-isa fma]

One engine per dtype (SmolLM2-135M, greedy, --prompt-len random tokens each); each round runs
--steps decode steps per arm, the arms in alternating order, and times them with
time.process_time (torch on --threads; moebus.loadtest.ab): the median tok/s per CPU-second of each
arm, with its slowest and fastest round.
"""
from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from moebus.loadtest.ab import alternate, wins


def _engine(dtype: str, batch: int, prompt_len: int, tokens: int):
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model="smollm2", dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=4096))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i, p in enumerate(torch.randint(100, 49000, (batch, prompt_len), generator=g).tolist()):
        eng.add_request(f"p{i}", p, params)
    for _ in range(3):  # prefill, then a couple of decode steps
        eng.step()
    return eng


def run(batch: int, rounds: int, steps: int, prompt_len: int, b_isa: str = "fma256") -> None:
    from moebus.kernels.lm_head_argmax import isas, lm_head_argmax, lm_head_argmax_cpu

    def b_head(x, w, panels):
        if b_isa == "logits":  # the unfused path: the logits GEMM (oneDNN), then their row argmax
            return torch.nn.functional.linear(x, w).argmax(dim=1)
        out = lm_head_argmax_cpu(x, w, panels, isa=b_isa if b_isa in isas(x.dtype) else "auto")
        return out if out is not None else lm_head_argmax(x, w, panels)

    tokens = 3 + 2 * rounds * steps + 16
    engines = {"bf16": _engine("bfloat16", batch, prompt_len, tokens), "fp32": _engine("float32", batch, prompt_len, tokens)}
    # The runner binds its head once (functools.partial of lm_head_argmax with the packed weight):
    # each arm swaps that bound call for one with its own head function.
    auto = {k: eng.runner.greedy_head for k, eng in engines.items()}
    if not all(isinstance(h, functools.partial) for h in auto.values()):
        raise SystemExit(f"no fused dense greedy head to compare: {auto}")
    heads = {k: {"auto": h, b_isa: functools.partial(b_head, *h.args, **h.keywords)} for k, h in auto.items()}

    def arm(eng_name: str, head: str) -> Callable[[], None]:
        def steps_with_head() -> None:
            engines[eng_name].runner.greedy_head = heads[eng_name][head]
            for _ in range(steps):
                engines[eng_name].step()
        return steps_with_head

    try:
        timed = alternate({f"{d} head {h}": arm(d, h) for d in engines for h in ("auto", b_isa)}, rounds,
                          clock=time.process_time)
    finally:
        for k, eng in engines.items():
            eng.runner.greedy_head = auto[k]
            eng.close()
    rate = {k: batch * steps / t.median for k, t in timed.items()}
    won = [wins(timed[f"{d} head auto"], timed[f"{d} head {b_isa}"]) for d in ("bf16", "fp32")]
    print(f"batch={batch} rounds={rounds} steps/round={steps} threads={torch.get_num_threads()}: " + ", ".join(
        f"{k} {rate[k]:.1f} [{batch * steps / t.spread[1]:.1f}-{batch * steps / t.spread[0]:.1f}]"
        for k, t in timed.items()) + f" tok/s per cpu-second (median [slowest-fastest round]); auto faster in "
        f"{won[0]} (bf16) and {won[1]} (fp32) of {rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--b-isa", default="fma256", choices=["fma", "fma256", "avx512_bf16", "amx", "logits"],
                    help="the B arms' head path (logits: no fused head, the GEMM then argmax)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for b in args.batch:
        run(b, args.rounds, args.steps, args.prompt_len, args.b_isa)


if __name__ == "__main__":
    main()
