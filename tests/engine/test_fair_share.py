"""Fair share of a batch (issue 36 item 5) on the real model: one API call with many sequences
(here n=16 choices) fills an 8-sequence batch while alone; another owner's request arriving then
gets its first token within two steps (the big call gives back sequences above its half of the
batch, which recompute later) instead of after the big call's choices end. Every choice still
produces its tokens; with `max_owner_share` 1.0 (no cap) the newcomer waits."""
from __future__ import annotations

import pytest

from moebus.engine.llm import LLM
from moebus.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

BIG = SamplingParams(n=16, temperature=0, max_tokens=24, ignore_eos=True)
SMALL = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smol_dir):
    return LLM(max_num_seqs=8, max_num_batched_tokens=512).engine


def _steps_to_first_token(eng, share: float, prompt: list[int]) -> tuple[int, dict[str, int]]:
    eng.scheduler.config.max_owner_share = share
    eng.block_manager.reset_prefix_cache()
    tokens: dict[str, int] = {}

    def step() -> list:
        outs = eng.step()
        for out in outs:
            key = out.request_id if out.request_id == "small" else f"big#{out.index}"
            tokens[key] = tokens.get(key, 0) + len(out.new_token_ids)
        return outs

    eng.add_request("big", prompt, BIG)
    while len(eng.scheduler.running) < 8:
        step()
    eng.add_request("small", prompt[:-3], SMALL)
    first, steps = None, 0
    while eng.has_unfinished_requests():
        steps += 1
        if first is None and any(o.request_id == "small" and o.new_token_ids for o in step()):
            first = steps
        elif first is not None:
            step()
    return first, tokens


def test_a_newcomer_starts_within_two_steps_beside_a_call_that_fills_the_batch(engine, chat_prompts) -> None:
    capped, tokens = _steps_to_first_token(engine, 0.5, chat_prompts[2])
    assert tokens["small"] == 4 and all(tokens[f"big#{i}"] == 24 for i in range(16)), tokens
    uncapped, _ = _steps_to_first_token(engine, 1.0, chat_prompts[2])
    print(f"\nsmall request's first token after {capped} steps with max_owner_share 0.5, "
          f"{uncapped} without a cap")
    assert capped <= 2 and uncapped > 20, (capped, uncapped)
