"""Engine throughput vs HF transformers `generate`, same weights, same machine, same run.

    python loadtest/bench_engine.py                       # SmolLM2-135M, 64 x (128 in / 128 out)
    python loadtest/bench_engine.py --model tiny-moe      # tiny DeepSeek-V4-style MoE
    python loadtest/bench_engine.py --requests 16 --output-len 32   # quick look
    python loadtest/bench_engine.py --threads 1 --no-hf --dtypes bfloat16   # async vs sync, one core left to the host
    python loadtest/bench_engine.py --model tiny-moe --no-hf --dtypes float32 --requests 256 \
        --max-num-seqs 256 --prompt-len 32 --output-len 64 --repeat 5      # async vs sync, host-heavy steps

For each dtype in --dtypes (default float32 and bfloat16) prints output tokens/s and mean per-step
latency of our engine (sync and async scheduling; also host ms, the wall time per step outside
model execution, which is what async scheduling hides) and of HF generate in that same dtype at
--hf-batch (and at batch 1 on a subset, first dtype only), then the ratios, same-dtype first and
then across dtypes. Greedy, EOS ignored: every request produces exactly --output-len tokens.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


def run_ours(engine: LLMEngine, prompts: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    n0 = len(engine.stats_.step_seconds)
    t0 = time.perf_counter()
    n_out = 0
    while engine.has_unfinished_requests():
        n_out += sum(len(o.new_token_ids) for o in engine.step())
    dt = time.perf_counter() - t0
    steps = engine.stats_.step_seconds[n0:]
    step_ms = 1000 * dt / max(len(steps), 1)
    # Wall time per step beyond the model's own execution: host work left on the critical path
    # (all of it when sync; what async scheduling failed to overlap when async).
    host_ms = step_ms - 1000 * sum(steps) / max(len(steps), 1)
    return {"tok_s": n_out / dt, "seconds": dt, "tokens": n_out, "step_ms": step_ms, "host_ms": host_ms}


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    t0 = time.perf_counter()
    n_out = 0
    steps = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        steps += out_len
    dt = time.perf_counter() - t0
    return {"tok_s": n_out / dt, "seconds": dt, "tokens": n_out, "step_ms": 1000 * dt / steps, "host_ms": None}


def _median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def _model_paths(name: str, tmp: Path) -> tuple[str, str | None, str]:
    """(engine model, tokenizer, HF-loadable dir)."""
    if name == "smollm2":
        from moebus.engine.loader.gguf_cache import converted_dir
        from moebus.text.gguf import embedded_gguf_path

        d = converted_dir(embedded_gguf_path())
        return "smollm2", None, str(d)
    from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4

    d = write_tiny_deepseek_v4(tmp / "moe", seed=0, vocab_size=49152, hidden_size=128, n_routed_experts=16,
                               num_experts_per_tok=2, moe_intermediate_size=64)
    return str(d), "smollm2", str(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-moe"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-single", type=int, default=4, help="requests run by HF at batch 1 (first dtype)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma list; each dtype runs ours (sync + async) and HF in that same dtype")
    ap.add_argument("--no-async", action="store_true", help="skip the async-scheduling run")
    ap.add_argument("--no-hf", action="store_true", help="only our engine (e.g. for the async comparison)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of our engine per mode, sync and async alternating; the median is reported")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch compute threads (default: all cores); fewer leaves cores to the host side")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    dtypes = args.dtypes.split(",")
    rows: dict[str, dict] = {}
    ours_best: dict[str, float] = {}  # dtype -> our better tok/s of sync and async
    ratios: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, hf_dir = _model_paths(args.model, Path(tmp))
        for dt in dtypes:
            torch_dtype = getattr(torch, dt)
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype).eval()
            prompts = _prompts(args.requests, args.prompt_len, hf.config.vocab_size)
            engines = {mode: LLMEngine(EngineConfig(model=model, tokenizer=tok, dtype=dt,
                                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096,
                                                    async_scheduling=mode))
                       for mode in ((False,) if args.no_async else (False, True))}
            runs: dict[bool, list[dict]] = {mode: [] for mode in engines}
            for eng in engines.values():
                run_ours(eng, prompts[:2], 4)  # warm-up
            for _ in range(args.repeat):  # sync and async alternate, so drifts in machine speed hit both
                for mode, eng in engines.items():
                    runs[mode].append(run_ours(eng, prompts, args.output_len))
            ours = {}
            for mode, eng in engines.items():
                ours[mode] = rows[f"moebus {dt} (async={mode}, max_num_seqs={args.max_num_seqs})"] = _median(runs[mode])
                eng.close()
            best = ours_best[dt] = max(r["tok_s"] for r in ours.values())
            if True in ours:
                ratios.append(f"async scheduling gain ({dt}): {ours[True]['tok_s'] / ours[False]['tok_s']:.3f}x")
            if args.no_hf:
                continue
            run_hf(hf, prompts[:1], 2, 1)  # warm-up
            base = rows[f"HF generate {dt} batch={args.hf_batch}"] = run_hf(hf, prompts, args.output_len, args.hf_batch)
            if dt == dtypes[0]:
                single = rows[f"HF generate {dt} batch=1"] = run_hf(hf, prompts[: args.hf_single], args.output_len, 1)
                ratios.append(f"ratio moebus/HF batch=1 ({dt}): {best / single['tok_s']:.2f}x")
            ratios.append(f"ratio moebus/HF batch={args.hf_batch} (both {dt}): {best / base['tok_s']:.2f}x")
            del hf
    if len(dtypes) > 1 and not args.no_hf:
        for dt in dtypes:
            for hf_dt in dtypes:
                if hf_dt != dt:
                    ratios.append(f"ratio moebus {dt} / HF {hf_dt} batch={args.hf_batch}: "
                                  f"{ours_best[dt] / rows[f'HF generate {hf_dt} batch={args.hf_batch}']['tok_s']:.2f}x")
    print(f"\nmodel={args.model} requests={args.requests} prompt={args.prompt_len} output={args.output_len} "
          f"torch_threads={torch.get_num_threads()}")
    print(f"{'system':55s} {'out tok/s':>10s} {'step ms':>9s} {'host ms':>8s} {'seconds':>8s}")
    for name, r in rows.items():
        host = "" if r["host_ms"] is None else f"{r['host_ms']:.2f}"
        print(f"{name:55s} {r['tok_s']:10.1f} {r['step_ms']:9.1f} {host:>8s} {r['seconds']:8.1f}")
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
