"""KV bytes per request with and without bounded sliding-window memory (kv.groups).

    python loadtest/bench_window_kv.py [--contexts 4096,32768,131072] [--tiny-contexts 4096]

1. The real DeepSeek-V4-Flash layout (`DeepseekV4Args()` defaults, built on the meta device: no
   weights), bf16, 16-token blocks: bytes a request holds while computing the last token of each
   context, from the KV specs and the pool layout (one group vs full + windowed groups).
2. Measured on tiny random V4 checkpoints (all-sliding and sliding/CSA/HCA/CSA, window 16, fp32):
   one request of each context decodes 4 tokens on a bounded engine and on an unbounded one; after
   every step the blocks it holds in each pool are counted and priced at the pool's bytes per block.
3. `--host-overhead`: the host cost of bounding, single-thread process time of `Scheduler.schedule`
   and `ModelRunner.prepare` per step, 32 requests of 500 prompt tokens decoding 64 tokens on the
   tiny sliding/CSA/HCA/CSA model, unbounded vs bounded, twice each.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from moebus.engine.llm import LLM
from moebus.engine.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams
from moebus.kv.groups import FULL, KVLayout

TINY = {
    "sliding-only": {},
    "sliding/CSA/HCA/CSA": dict(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"], index_n_heads=8, index_topk=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32}),
}


def v4_flash(contexts: list[int]) -> None:
    with torch.device("meta"):
        specs = DeepseekV4ForCausalLM(DeepseekV4Args()).kv_cache_specs()
    bs, dt = 16, torch.bfloat16
    one, two = KVLayout.plan(specs, False), KVLayout.plan(specs, True)
    full_b, win_b = two.bytes_per_block(specs, bs, dt)
    print(f"V4-Flash bf16: {one.bytes_per_block(specs, bs, dt)[FULL]:,} B/block unbounded; bounded: full "
          f"{full_b:,} + windowed {win_b:,} B/block, horizon {two.horizon}")
    print("| context | unbounded | bounded | ratio | blocks held (full, windowed) |")
    for n in contexts:
        b, a = one.bytes_per_request(specs, n, bs, dt), two.bytes_per_request(specs, n, bs, dt)
        print(f"| {n:,} | {b:,} ({b / 2**20:,.1f} MiB) | {a:,} ({a / 2**20:,.1f} MiB) | {b / a:.1f}x | "
              f"{two.blocks_per_request(n, bs)} |")


def held_bytes(ckpt: str, context: int, bounded: bool) -> list[tuple[int, int, int]]:
    """(bytes, full blocks, windowed blocks) one request of `context` tokens holds: the most in any
    step (a 2048-token prefill chunk), and in its last decode step."""
    llm = LLM(ckpt, tokenizer="smollm2", bound_sliding_window=bounded, enable_prefix_caching=False,
              max_model_len=context + 8, num_kv_blocks=context // 16 + 8, max_num_batched_tokens=2048)
    eng = llm.engine
    per_full, per_win = eng.kv_layout.bytes_per_block(eng.model.kv_cache_specs(), 16, torch.float32)
    prompt = torch.randint(3, 500, (context - 4,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        for r in eng.scheduler.running:
            n_full, n_win = len(r.block_ids), sum(1 for b in r.window_block_ids if b >= 0)
            held.append((n_full * per_full + n_win * per_win, n_full, n_win))
    return [max(held), held[-1]]


def host_overhead(ckpt: str, bounded: bool) -> str:
    llm = LLM(ckpt, tokenizer="smollm2", bound_sliding_window=bounded, enable_prefix_caching=False,
              num_kv_blocks=2048, max_num_batched_tokens=4096)
    eng = llm.engine
    spent = {"schedule": 0.0, "prepare": 0.0}
    steps = 0
    for name, owner in (("schedule", eng.scheduler), ("prepare", eng.runner)):
        def timed(*args, _f=getattr(owner, name), _name=name, **kw):
            t = time.process_time()
            try:
                return _f(*args, **kw)
            finally:
                spent[_name] += time.process_time() - t
        setattr(owner, name, timed)
    g = torch.Generator().manual_seed(0)
    for i in range(32):
        eng.add_request(f"r{i}", torch.randint(3, 500, (500,), generator=g).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    return (f"bounded={bounded}: {steps} steps, schedule {spent['schedule'] / steps * 1e3:.3f} ms/step, "
            f"prepare {spent['prepare'] / steps * 1e3:.3f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--tiny-contexts", default="4096")
    ap.add_argument("--tiny-layouts", default=",".join(TINY), help="comma-separated names of TINY")
    ap.add_argument("--host-overhead", action="store_true")
    a = ap.parse_args()
    if a.host_overhead:
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as d:
            ckpt = str(write_tiny_deepseek_v4(d, seed=1, **TINY["sliding/CSA/HCA/CSA"]))
            for bounded in (False, True, False, True):
                print(host_overhead(ckpt, bounded))
        return
    v4_flash([int(x) for x in a.contexts.split(",")])
    print("\n| tiny layout | context | unbounded: bytes (full blocks) | bounded, peak (prefill chunk): bytes "
          "(full, windowed blocks) | bounded, last decode step |")
    for name in a.tiny_layouts.split(","):
        kinds = TINY[name]
        with tempfile.TemporaryDirectory() as d:
            ckpt = str(write_tiny_deepseek_v4(d, seed=1, **kinds))
            for n in (int(x) for x in a.tiny_contexts.split(",")):
                (u, _), (peak, last) = held_bytes(ckpt, n, False), held_bytes(ckpt, n, True)
                print(f"| {name} | {n:,} | {u[0]:,} ({u[1]}) | {peak[0]:,} ({peak[1]}, {peak[2]}) | "
                      f"{last[0]:,} ({last[1]}, {last[2]}) |")

if __name__ == "__main__":
    main()
