"""A/B in process: the MoE router's lean softmax path (top-k of the logits, one softmax over k) vs the
generic one it replaced (softmax over E, top-k, gather, renormalise), a c=1 decode step on one
engine, alternating rounds (BENCHMARKS.md, issue 35).

    .venv/bin/python loadtest/ab_moe_router.py /work/peers/granite-moe
"""
import sys
import time

import torch
import torch.nn.functional as F

from moebus.engine.config import EngineConfig
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.models import moe as moe_mod
from moebus.engine.sampling import SamplingParams

new_forward = moe_mod.Router.forward
def old_forward(self, x, input_ids):
    w = self.weight.float()
    scores = moe_mod.router_scores(F.linear(x.float(), w), self.scoring_func)
    choice = scores
    ids = torch.topk(choice, self.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * self.routed_scaling_factor, ids

eng = LLMEngine(EngineConfig(model=sys.argv[1], dtype="bfloat16", max_model_len=4096, num_kv_blocks=256))
ids = torch.randint(100, 49000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
res = {"old": [], "new": []}
for rnd in range(4):
    for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
        moe_mod.Router.forward = old_forward if name == "old" else new_forward
        eng.add_request(f"{name}{rnd}", ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        for _ in range(5):
            eng.step()
        t, n = time.perf_counter(), 25
        for _ in range(n):
            eng.step()
        res[name].append((time.perf_counter() - t) / n * 1000)
        while eng.has_unfinished_requests():
            eng.step()
for k, v in res.items():
    print(k, " ".join(f"{x:.2f}" for x in v), "median", sorted(v)[len(v)//2])
