"""DeepSeek-V4 MTP drafting: acceptance and verify steps on tiny checkpoints (issue 17, item 3).

    flock /tmp/moebus-bench.lock python loadtest/bench_mtp.py

8 prompts (3..90 tokens, window 16) decode 64 greedy tokens as one batch, without drafts and with
speculative_method="mtp" at k = 1, 2, 3: tokens must match; prints acceptance, engine steps and the
single-thread process time of `MTPProposer.propose`.
1. Random checkpoints (seeds 0-2): the nextn layer is unrelated to the target, so acceptance sits
   at chance (vocabulary 512); this shows the path runs and stays exact, not what MTP buys.
2. The arranged-weights checkpoint of tests/engine/test_mtp.py (the nextn layer computes exactly
   the target's next token): every draft is accepted, steps fall to ~64/(k+1).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from moebus.engine.llm import LLM
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from test_mtp import _oracle_checkpoint  # noqa: E402

LENGTHS = (3, 9, 17, 24, 40, 55, 70, 90)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
ENGINE = dict(tokenizer="smollm2", enable_prefix_caching=False, num_kv_blocks=128)


def run(name: str, ckpt: str, prompts: list[list[int]]) -> None:
    plain = LLM(ckpt, **ENGINE)
    ref = [r.outputs[0].token_ids for r in plain.generate(prompts, GREEDY)]
    for k in (1, 2, 3):
        llm = LLM(ckpt, num_speculative_tokens=k, speculative_method="mtp", **ENGINE)
        proposer, spent = llm.engine.draft_proposer, [0.0, 0]
        propose = proposer.propose

        def timed(batch, hidden, kk, propose=propose, spent=spent):
            t0 = time.process_time()
            out = propose(batch, hidden, kk)
            spent[0] += time.process_time() - t0
            spent[1] += 1
            return out

        proposer.propose = timed
        t0 = time.process_time()
        out = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
        total = time.process_time() - t0
        s = llm.engine.spec_stats
        print(f"{name} k={k}: same tokens {out == ref}, acceptance {s.acceptance_rate:.4f} "
              f"({s.num_accepted}/{s.num_draft_tokens}), steps {llm.engine.stats_.steps} vs "
              f"{plain.engine.stats_.steps} plain, propose {1e3 * spent[0] / max(spent[1], 1):.2f} ms/call "
              f"= {100 * spent[0] / total:.0f}% of process time")


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (0, 1, 2):
            ckpt = write_tiny_deepseek_v4(Path(tmp) / f"s{seed}", seed=seed, num_nextn_predict_layers=1)
            run(f"random seed {seed}", str(ckpt), prompts)
        run("arranged", _oracle_checkpoint(str(Path(tmp) / "s0"), Path(tmp) / "arranged"), prompts)


if __name__ == "__main__":
    main()
