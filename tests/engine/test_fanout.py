"""n > 1 fans out inside LLMEngine: one add_request, n choices seeded seed + i that share the
prompt's KV blocks (the later ones wait for the first one's prefill); outputs name the request
and the choice; aborting the request ends every choice."""
from __future__ import annotations

import pytest

from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams

N, SEED, MAX_TOKENS = 4, 5, 8
PARAMS = SamplingParams(n=N, temperature=0.9, top_p=0.95, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)


def _drain(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def _blocks(n_tokens: int, bs: int) -> int:
    return -(-n_tokens // bs)


def test_choices_share_the_prompt_blocks_and_equal_separate_seeded_requests(llm, chat_prompts):
    eng = llm.engine
    prompt = chat_prompts[1] + [17, 23]  # a prompt no other test cached
    bs = eng.block_manager.block_size
    # the old way (the worker's before the engine fanned out): n requests seeded seed + i, all at once
    for i in range(N):
        eng.add_request(f"old-{i}", prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=SEED + i,
                                                           max_tokens=MAX_TOKENS, ignore_eos=True))
    old: dict[int, list[int]] = {}
    for out in _drain(eng):
        old.setdefault(int(out.request_id.removeprefix("old-")), []).extend(out.new_token_ids)
    eng.block_manager.reset_prefix_cache()

    before = eng.stats()
    eng.add_request("fan", prompt, PARAMS)
    outs = _drain(eng)
    after = eng.stats()
    assert {o.request_id for o in outs} == {"fan"}
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    for o in outs:
        tokens.setdefault(o.index, []).extend(o.new_token_ids)
        cached[o.index] = o.num_cached_tokens
        assert o.error is None
    assert tokens == old and all(len(t) == MAX_TOKENS for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # the choices are seeded apart
    # the prompt's full blocks are computed once: the 3 later choices hit them in the prefix cache
    shared = (len(prompt) - 1) // bs
    assert cached == {0: 0, **{i: shared * bs for i in range(1, N)}}
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == N - 1
    per_choice = _blocks(len(prompt) + MAX_TOKENS - 1, bs)  # the last sampled token is never computed
    assert after["kv_blocks_allocated"] - before["kv_blocks_allocated"] == N * per_choice - (N - 1) * shared
    assert eng.block_manager.num_free_blocks == len(eng.block_manager.blocks)


def test_abort_ends_every_choice(llm, chat_prompts):
    eng = llm.engine
    eng.add_request("gone", chat_prompts[0], PARAMS)
    eng.step()
    assert eng.get_request("gone", 3).request_id == "gone#3"
    assert eng.abort_request("gone") and not eng.abort_request("gone")
    assert not eng.has_unfinished_requests() and "gone#0" not in eng.tracked
    assert eng.block_manager.num_free_blocks == len(eng.block_manager.blocks)
    with pytest.raises(KeyError):
        eng.get_request("gone")


def test_request_ids_and_choice_ids_do_not_collide(llm, chat_prompts):
    eng = llm.engine
    eng.add_request("dup", chat_prompts[0], PARAMS)
    for rid, params in (("dup", SamplingParams()), ("dup#1", SamplingParams())):
        with pytest.raises(ValueError, match="duplicate"):
            eng.add_request(rid, chat_prompts[0], params)
    assert eng.abort_request("dup") and not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="one choice"):
        eng.add_prefilled("pre", chat_prompts[0], 42, PARAMS)
    assert "pre" not in eng.tracked and not eng.has_unfinished_requests()
