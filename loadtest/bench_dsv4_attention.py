"""Tiny DeepSeek-V4: decode step time and tokens/s with all three attention kinds vs sliding-only.

    python loadtest/bench_dsv4_attention.py [--batch 8] [--prompt-len 200] [--output-len 64]

Two random 4-layer checkpoints of the same size (hf_checkpoint.write_tiny_deepseek_v4): every
layer sliding (window 16), and sliding / CSA (rate 4, top-16 of the indexer) / HCA (rate 32) / CSA.
Greedy, EOS ignored; prints ms per decode step, output tokens/s over the decode steps and the KV
bytes per token of each layout (fp32, 16-token blocks).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from moebus.engine.llm import LLM
from moebus.engine.model_runner import kv_bytes_per_block
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams

LAYOUTS = {
    "sliding-only": ["sliding_attention"] * 4,
    "sliding/CSA/HCA/CSA": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len + 1, min_tokens=args.output_len + 1,
                            ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, kinds in LAYOUTS.items():
            ckpt = write_tiny_deepseek_v4(f"{tmp}/{len(kinds)}-{name[0]}", seed=0, layer_types=kinds,
                                          index_n_heads=8, index_topk=16,
                                          compress_rates={"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 32})
            llm = LLM(str(ckpt), tokenizer="smollm2", enable_prefix_caching=False, max_num_batched_tokens=8192,
                      num_kv_blocks=args.batch * ((args.prompt_len + args.output_len) // 16 + 2))
            engine = llm.engine
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            for i, p in enumerate(prompts):
                engine.add_request(f"{name}-{i}", p, params)
            engine.step()  # the prefill (and each request's first token)
            n, steps, t0 = 0, 0, time.perf_counter()
            while engine.has_unfinished_requests():
                n += sum(len(o.new_token_ids) for o in engine.step())
                steps += 1
            dt = time.perf_counter() - t0
            kv = kv_bytes_per_block(engine.runner.model.kv_cache_specs(), 16, torch.float32) / 16
            print(f"{name:>20}: {steps} decode steps, {1000 * dt / steps:.1f} ms/step, {n / dt:.0f} tok/s "
                  f"(batch {args.batch}, context {args.prompt_len}-{args.prompt_len + args.output_len}), "
                  f"KV {kv:.0f} B/token")


if __name__ == "__main__":
    main()
