"""What a sampled (temperature 1) decode step costs over a greedy one, by part, and in the engine.

    python loadtest/bench_sampler.py                  # parts at B=16/64, then engine steps at c=16/64
    python loadtest/bench_sampler.py --no-engine      # parts only (~1 min)
    python loadtest/bench_sampler.py --threads 2 --rounds 12

Parts (SmolLM2-135M's real LM head: hidden 576, vocab 49152; random hidden rows), medians of --repeat
calls, alternating: (a) the greedy fused head+argmax; (b) temperature 1, (c) temperature 1 with
top_k=50, top_p=0.9: the logits GEMM (compute_logits), SamplingBatch.build, and the Sampler, now
and as it was before the inverse-CDF kernel (`legacy`: float32 copy, temperature, top-k/top-p by a
full sort, softmax, [B, V] Exp(1) noise from torch's exponential_, exponential race), each piece
timed alone.

Engine: one engine per variant (greedy; temperature 1 and temperature 1 with top_k=50, top_p=0.9,
each on the Sampler and on the legacy one), B requests decoding in each; --steps decode steps per
variant per round, variants alternating for --rounds rounds (moebus.loadtest.ab); prints the median
over rounds of wall ms per step (fastest-slowest round) and tok/s. Times are perf_counter on a shared box: compare within a run, with the load average printed.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingBatch, SamplingParams
from moebus.engine.sampling.processors import NEG_INF, exponential_race, row_argmax
from moebus.engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    compute_logprobs,
    draw_uniforms,
    prepare_logits,
    sampling_floor,
)
from moebus.kernels import lm_head_argmax, sample_logits
from moebus.loadtest.ab import alternate

PLAIN = SamplingParams(temperature=1.0, max_tokens=4096, ignore_eos=True)
TRUNC = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=4096, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)


def draw_exponentials(batch: SamplingBatch, rows: int, vocab: int) -> torch.Tensor:
    q = torch.empty(rows, vocab).exponential_()
    for r in batch.seeded_rows:
        q[r].exponential_(generator=batch.generators[r])
    return q


def legacy_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p (by a full sort when top_p is set), softmax, as the Sampler did
    before truncation_floor (min-p left out: not benchmarked). Consumes x."""
    x = x.div_(batch.temperature.unsqueeze(1))
    top_k, top_p, vocab = batch.top_k, batch.top_p, x.shape[1]
    if top_p is not None:
        sorted_logits, order = x.sort(dim=1, descending=True)
        if top_k is not None:
            kth = sorted_logits.gather(1, (top_k.clamp(max=vocab) - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
        probs = sorted_logits.softmax(dim=1)
        drop = (probs.cumsum(dim=1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        drop &= (top_p < 1.0).unsqueeze(1)
        x = torch.empty_like(x).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))
    elif top_k is not None:
        k = top_k.clamp(max=vocab)
        kth = x.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, NEG_INF)
    return x.softmax(dim=1)


class LegacySampler(Sampler):
    """The Sampler before the inverse-CDF kernel (exponential race over [B, V] noise), for A/B."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        x = logits if batch.all_greedy and not batch.modifies_logits else prepare_logits(logits, batch)
        tokens = row_argmax(x)
        if not batch.all_greedy:
            probs = legacy_probs(x, batch)
            q = draw_exponentials(batch, *probs.shape)
            tokens = torch.where(batch.greedy, tokens, exponential_race(probs, q))
        lp = compute_logprobs(logits, tokens, batch.max_num_logprobs) if batch.max_num_logprobs is not None else None
        return SamplerOutput(tokens, lp)


@torch.inference_mode()
def parts(runner, b: int, repeat: int) -> None:
    model, head = runner.model, runner.greedy_head
    x = torch.randn(b, head[0].shape[1]) * 2
    logits = model.compute_logits(x)
    vocab = logits.shape[1]
    legacy, sampler = LegacySampler(), Sampler()
    fns = {"(a) greedy fused head+argmax": lambda: lm_head_argmax(x, *head),
           "logits GEMM (compute_logits)": lambda: model.compute_logits(x),
           "row_argmax of the logits": lambda: row_argmax(logits)}
    for tag, p in (("(b) T=1", PLAIN), ("(c) T=1 top_k=50 top_p=0.9", TRUNC)):
        batch = SamplingBatch.build([p] * b, [[1, 2, 3]] * b, [[5] * 128] * b, [None] * b, vocab, "cpu")
        probs = legacy_probs(prepare_logits(logits, batch), batch)
        fns |= {
            f"{tag} SamplingBatch.build": lambda p=p: SamplingBatch.build([p] * b, [[1, 2, 3]] * b, [[5] * 128] * b,
                                                                        [None] * b, vocab, "cpu"),
            f"{tag} legacy Sampler total": lambda batch=batch: legacy(logits, batch),
            f"{tag} legacy: float32 copy": lambda batch=batch: prepare_logits(logits, batch),
            f"{tag} legacy: temp/trunc + softmax": lambda batch=batch: legacy_probs(logits.clone(), batch),
            f"{tag} legacy: Exp(1) noise": lambda batch=batch: draw_exponentials(batch, b, vocab),
            f"{tag} legacy: race": lambda probs=probs: exponential_race(probs, torch.ones_like(probs)),
            f"{tag} new Sampler total": lambda batch=batch: sampler(logits, batch),
            f"{tag} new: draw_uniforms": lambda batch=batch: draw_uniforms(batch, logits.device, None),
        }
        if p is TRUNC:
            fns[f"{tag} new: sampling_floor (top-k/top-p)"] = lambda batch=batch: sampling_floor(logits, batch)
    t, u = torch.ones(b), torch.rand(b, dtype=torch.float64)
    fns["sample_logits kernel alone"] = lambda: sample_logits(logits, t, u)
    print(f"\nB={b} vocab={vocab}: median ms [fastest-slowest] of {repeat} interleaved calls")
    for k, t in alternate(fns, repeat, warmup=1).items():
        print(f"  {k:45s} {1e3 * t.median:8.2f} [{1e3 * t.spread[0]:.2f}-{1e3 * t.spread[1]:.2f}]")


def _engine(b: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2", dtype="float32", max_num_seqs=b, max_num_batched_tokens=4096))


def engine_ab(b: int, prompt_len: int, steps: int, rounds: int) -> None:
    variants = {"greedy": (GREEDY, None), "T=1": (PLAIN, None), "T=1 legacy sampler": (PLAIN, LegacySampler()),
                "T=1 k50 p0.9": (TRUNC, None), "T=1 k50 p0.9 legacy": (TRUNC, LegacySampler())}
    engines = {}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49000, (b, prompt_len), generator=g).tolist()
    for name, (params, sampler) in variants.items():
        eng = engines[name] = _engine(b)
        if sampler is not None:
            eng.runner.sampler = sampler
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}-{i}", p, params)
        for _ in range(4):  # prefill and a few decode steps
            eng.step()

    def decode(eng: LLMEngine) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                eng.step()
        return run

    timed = alternate({name: decode(eng) for name, eng in engines.items()}, rounds)
    for eng in engines.values():
        eng.close()
    base = timed["greedy"].median
    print(f"\nengine c={b}: median wall ms per decode step over {rounds} rounds of {steps} steps, variants alternating")
    for name, t in timed.items():
        ms, (lo, hi) = 1e3 * t.median / steps, t.spread
        print(f"  {name:22s} {ms:8.1f} ms [{1e3 * lo / steps:.1f}-{1e3 * hi / steps:.1f}]  {1e3 * b / ms:7.1f} tok/s"
              f"  {base / t.median:5.3f}x greedy's tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu flags {' '.join(isa)}, "
          f"loadavg {os.getloadavg()[0]:.2f}")
    eng = _engine(max(args.batch))
    for b in args.batch:
        parts(eng.runner, b, args.repeat)
    eng.close()
    if not args.no_engine:
        for b in args.batch:
            engine_ab(b, args.prompt_len, args.steps, args.rounds)
    print(f"\nloadavg at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
