"""EP=2 (two gloo ranks, one thread each) on an MoE checkpoint against one worker, and what EPLB does
to skewed routing. In process, not through HTTP: these are engine figures.

Phases, every rank serving its own requests (random 64-token prompts, greedy, 32 tokens each):
1. baseline: one process, both cores, all requests -> decode tok/s;
2. EP=2 before EPLB: the ranks' measured expert loads (max/mean over ranks) and decode tok/s;
3. EPLB rebalance (redundant expert copies placed where the load is), then the same again.
The skewed checkpoint (`loadtest/moe_checkpoint.py --skew 0.5`) sends about half the assignments
to 3 of 32 experts, all on rank 0 in the initial placement.

    .venv/bin/python loadtest/eplb_skew.py --model /work/peers/granite-moe-skew --requests 8
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moebus.engine.config import EngineConfig
from moebus.engine.distributed.dp_engine import DPEngine, EPConfig
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = {"dtype": "bfloat16", "max_model_len": 512, "num_kv_blocks": 256}


def prompts(tag: str, n: int) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(hash(tag) % 2**31)
    return [(f"{tag}-{i}", torch.randint(100, 49000, (64,), generator=g).tolist()) for i in range(n)]


def decode_rate(engine, reqs: list[tuple[str, list[int]]]) -> float:
    """Adds the requests, runs their prefill (every one has its first token), then times the decode
    to the end: tokens/s. A DPEngine finishes with run_to_completion (a collective: every rank steps
    until the whole group is idle)."""
    for rid, ids in reqs:
        engine.add_request(rid, ids, PARAMS)
    started: set[str] = set()
    while len(started) < len(reqs):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    start = time.perf_counter()
    if isinstance(engine, DPEngine):
        tokens = sum(len(t) for t in engine.run_to_completion().values())
    else:
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def rank_main(engine: DPEngine, n: int) -> dict:
    rank = engine.group.rank
    out = {}
    engine.reset_loads()
    out["before_tok_s"] = decode_rate(engine, prompts(f"a{rank}", n))
    out["imbalance_before"] = engine.load_imbalance()
    reports = engine.rebalance(min_gain=0.0)
    out["moves"] = sum(r.num_moves for r in reports)
    engine.reset_loads()
    out["after_tok_s"] = decode_rate(engine, prompts(f"b{rank}", n))
    out["imbalance_after"] = engine.load_imbalance()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=8, help="per rank (the single worker serves them all)")
    ap.add_argument("--redundant", type=int, default=2, help="redundant expert copies over the group")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    single = LLMEngine(EngineConfig(model=str(args.model), **ENGINE))
    base = decode_rate(single, prompts("a0", args.requests) + prompts("a1", args.requests))
    single.close()
    del single
    results = launch_ep_group(str(args.model), 2, rank_main, (args.requests,), engine_kwargs=ENGINE,
                              ep=EPConfig(num_redundant_experts=args.redundant, count_loads=True),
                              torch_threads=1, start_method="forkserver", preload=["moebus.engine.distributed"],
                              timeout_s=1800)
    summary = {"model": str(args.model), "single_worker_tok_s": base,
               "ep2_before_tok_s": sum(r["before_tok_s"] for r in results),
               "ep2_after_tok_s": sum(r["after_tok_s"] for r in results),
               "imbalance_before": results[0]["imbalance_before"], "imbalance_after": results[0]["imbalance_after"],
               "expert_moves": results[0]["moves"]}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
