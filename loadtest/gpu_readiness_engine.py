"""The engine part of gpu_readiness.py: HF parity and decode throughput of LLMEngine on one device.

Parity is `moebus eval`'s machinery (moebus.eval.run): HF transformers fp32 on CPU is the reference
(chunk logits of a fixed text, greedy tokens of a prompt set); the engine, fp32 on the device, is
scored by decode-step logits (KL, same top token, PPL) and its greedy tokens (divergences at a
reference tie are allowed), with the bounds of the tests that gate the CPU engine the same way.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.eval import tiny_v4
from moebus.eval.candidate import greedy_params
from moebus.eval.configs import ALONE, TINY_V4, EvalConfig
from moebus.eval.metrics import greedy_stats
from moebus.eval.run import Settings, measure, prepare

# (model, CI-sized settings, full settings); the bounds below are those of the tests named
PARITY = {
    "smollm2": (Settings(ctx=64, max_chunks=1, max_prompts=2, max_tokens=8),
                Settings(ctx=512, max_chunks=2, max_prompts=16, max_tokens=32)),
    TINY_V4: (Settings(model=TINY_V4, ctx=64, max_chunks=1, max_prompts=3, max_tokens=8),
              Settings(model=TINY_V4, ctx=256, max_chunks=2, max_prompts=16, max_tokens=32)),
}


def _bounds(model: str, r: dict[str, Any]) -> dict[str, bool]:
    if model == TINY_V4:  # tests/eval/test_eval_tiny_v4.py::test_v4_fp32_matches_hf_fp32
        return {"kl < 1e-6": r["kl"] < 1e-6, "same top 100%": r["same_top_pct"] == 100.0,
                "greedy: no divergence but at ties": not r["real_divergences"]}
    return {"|PPL ratio - 1| < 1e-3": abs(r["ppl_ratio"] - 1) < 1e-3,  # test_quality_gate.py::test_fp32_matches_hf_fp32
            "kl < 1e-4": r["kl"] < 1e-4, "greedy: no divergence but at ties": not r["real_divergences"]}


def parity(model: str, device: str, quick: bool) -> dict[str, Any]:
    """One row: the engine fp32 on `device` against HF transformers fp32 (CPU) on the same weights."""
    t0 = time.perf_counter()
    settings = PARITY[model][0 if quick else 1]
    with tiny_v4.resolved(settings) as s:  # tiny-v4: the checkpoint written for this run, synthetic ids
        ref, _ = prepare(s)
        cfg = EvalConfig(f"fp32-{device}", {"dtype": "float32", "device": device}, ALONE)
        m = measure(s, ref, cfg)
    g = greedy_stats(ref.tokens, ref.path_logits, m.tokens, s.tie_margin)
    row: dict[str, Any] = {
        "model": model, "engine": f"LLMEngine fp32 on {device}", "reference": "HF transformers fp32 on cpu",
        "scored_tokens": m.ppl.tokens, "kl": m.ppl.kl, "same_top_pct": m.ppl.same_top_pct, "ppl": m.ppl.ppl,
        "ref_ppl": ref.stats.ppl, "ppl_ratio": m.ppl.ppl / ref.stats.ppl, "prompts": g.prompts,
        "greedy_tokens": ref.max_tokens, "greedy_matched": g.matched, "ties": len(g.ties),
        "real_divergences": [dataclasses.asdict(d) for d in g.real]}
    row["checks"] = _bounds(model, row)
    row["ok"] = all(row["checks"].values()) and all(len(t) == ref.max_tokens for t in m.tokens)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _decode_run(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """`batch` random prompts at once: the decode clock starts when every one has its first token
    (prefill done; tokens of that step uncounted), so prefill stays out of the decode figure."""
    g = torch.Generator().manual_seed(seed)  # a seed per run: no prefix-cache hits on a warm-up's prompts
    prompts = torch.randint(100, engine.vocab_size - 1, (batch, prompt_len), generator=g).tolist()
    for i, p in enumerate(prompts):
        engine.add_request(f"readiness-{batch}-{time.monotonic_ns()}-{i}", p, greedy_params(output_len))
    t0 = time.perf_counter()
    started: set[str] = set()
    t_decode = None
    tokens = steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t_decode is None:
            started.update(o.request_id for o in outs if o.new_token_ids)
            t_decode = time.perf_counter() if len(started) == batch else None
        else:
            tokens += sum(len(o.new_token_ids) for o in outs)
            steps += 1
    end = time.perf_counter()
    decode_s = end - (t_decode or end)
    return {"batch": batch, "prefill_s": round((t_decode or end) - t0, 4), "decode_steps": steps,
            "decode_tokens": tokens, "decode_s": round(decode_s, 4),
            "decode_tok_s": tokens / decode_s if decode_s > 0 else 0.0,
            "step_ms": 1000 * decode_s / steps if steps else 0.0}


def throughput(device: str, batches: list[int], prompt_len: int, output_len: int, dtype: str) -> list[dict[str, Any]]:
    """Decode tok/s of the in-process engine (LLMEngine.step; no HTTP, no services) on SmolLM2, greedy,
    EOS ignored; each batch size after a short warm-up at that size (Triton compiles per shape)."""
    engine = LLMEngine(EngineConfig(model="smollm2", device=device, dtype=dtype, max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(2048, prompt_len)))
    rows = []
    try:
        for b in batches:
            _decode_run(engine, b, prompt_len, 2, seed=2 * b)
            row = _decode_run(engine, b, prompt_len, output_len, seed=2 * b + 1)
            row |= {"model": "smollm2", "dtype": engine.config.dtype, "device": device, "prompt_len": prompt_len,
                    "output_len": output_len, "kind": "in-process LLMEngine.step loop (no HTTP)",
                    "ok": row["decode_tok_s"] > 0}
            rows.append(row)
    finally:
        engine.close()
    return rows
