"""Engine modes side by side on SmolLM2: n-gram speculative decoding and deterministic mode.

    python loadtest/bench_modes.py

Workload: 8 chat requests asking the model to repeat a passage (where prompt lookup can draft),
greedy, 96 output tokens. Prints output tokens/s, engine steps, spec acceptance rate, and whether
outputs are identical to the baseline (they must be: spec decode and deterministic mode are exact).
"""
from __future__ import annotations

import time

from moebus.engine.llm import LLM
from moebus.engine.sampling import SamplingParams

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
           "single step. All that glitters is not gold. Actions speak louder than words.")


def run(llm: LLM, convs: list[list[dict]], params: SamplingParams) -> tuple[list[list[int]], float, int]:
    steps0 = llm.engine.stats_.steps
    t0 = time.perf_counter()
    res = llm.chat(convs, params)
    return [r.outputs[0].token_ids for r in res], time.perf_counter() - t0, llm.engine.stats_.steps - steps0


def main() -> None:
    convs = [[{"role": "user", "content": f"Repeat this text exactly, twice: {PASSAGE} ({i})"}] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    rows = []
    base_llm = LLM()
    run(base_llm, convs[:1], SamplingParams(max_tokens=2))  # warm-up
    base, dt, steps = run(base_llm, convs, params)
    rows.append(("baseline", sum(map(len, base)) / dt, steps, "-", True))
    for k in (2, 4):
        spec = LLM(num_speculative_tokens=k)
        out, dt, steps = run(spec, convs, params)
        rate = spec.engine.spec_stats.acceptance_rate
        rows.append((f"n-gram spec, k={k}", sum(map(len, out)) / dt, steps, f"{rate:.2f}", out == base))
    det = LLM(deterministic=True)
    out, dt, steps = run(det, convs, params)
    rows.append(("deterministic mode", sum(map(len, out)) / dt, steps, "-", out == base))
    print(f"\n{'mode':22s} {'out tok/s':>10s} {'steps':>6s} {'accept':>7s} {'same tokens':>12s}")
    for name, tps, steps, rate, same in rows:
        print(f"{name:22s} {tps:10.1f} {steps:6d} {rate:>7s} {str(same):>12s}")
    for name, tps, *_ in rows[1:]:
        print(f"{name}: {tps / rows[0][1]:.2f}x baseline throughput")


if __name__ == "__main__":
    main()
