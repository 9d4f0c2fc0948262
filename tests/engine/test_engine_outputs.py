"""End-to-end engine behaviour on the real model: every scheduling feature must leave greedy output unchanged."""
import dataclasses
import json

import pytest

from moebus.engine.llm import LLM
from moebus.engine.sampling import SamplingParams, StructuredOutputParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(llm, chat_prompts):
    """Each prompt alone, greedy."""
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in chat_prompts]


def _tokens(results):
    return [r.outputs[0].token_ids for r in results]


def test_batched_equals_unbatched(llm, chat_prompts, reference):
    assert _tokens(llm.generate(chat_prompts, GREEDY)) == reference


def test_chunked_prefill_async_and_spec_decode_keep_greedy_output(chat_prompts, reference):
    for kw in ({"max_num_batched_tokens": 16}, {"async_scheduling": True}, {"num_speculative_tokens": 3}):
        other = LLM(**kw)
        assert _tokens(other.generate(chat_prompts, GREEDY)) == reference, kw
        if "num_speculative_tokens" in kw:
            stats = other.engine.spec_stats
            print(f"n-gram spec decode: {stats.num_draft_tokens} drafts, acceptance {stats.acceptance_rate:.2f}")
            assert stats.num_draft_tokens > 0


def test_fused_greedy_head_matches_the_logits_path(llm, chat_prompts, reference):
    """Greedy steps on CPU take their tokens from the fused LM-head argmax kernel; the logits path
    (forced here, and taken by any step holding a request that needs logits) gives the same."""
    runner = llm.engine.runner
    assert runner.greedy_head is not None and runner.raw_argmax  # CPU, not deterministic: fused path on
    head, runner.greedy_head = runner.greedy_head, None
    try:
        assert _tokens(llm.generate(chat_prompts, GREEDY)) == reference  # logits, then their argmax
        runner.raw_argmax = False
        assert _tokens(llm.generate(chat_prompts, GREEDY)) == reference  # logits, then the sampler
    finally:
        runner.greedy_head, runner.raw_argmax = head, True
    # one request with logprobs sends every step of the batch down the logits path
    params = [GREEDY, dataclasses.replace(GREEDY, logprobs=2), GREEDY, GREEDY]
    for i, (ids, p) in enumerate(zip(chat_prompts, params, strict=True)):
        llm.engine.add_request(f"mixed-{i}", ids, p)
    tokens: dict[str, list[int]] = {f"mixed-{i}": [] for i in range(4)}
    logprobs = 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs += len(out.logprobs or [])
    assert list(tokens.values()) == reference
    assert logprobs == len(reference[1])


def test_preemption_under_tiny_kv_cache_keeps_output(chat_prompts, reference):
    small = LLM(num_kv_blocks=12, block_size=8)  # 96 slots for 4 prompts of ~40 + 24 tokens
    out = small.generate(chat_prompts, GREEDY)
    assert _tokens(out) == reference
    assert sum(r.num_preemptions for r in small.engine.scheduler.waiting) == 0  # all done
    assert small.engine.block_manager.num_free_blocks == 12


def test_prefix_cache_hit_on_repeat(llm, chat_prompts, reference):
    first = llm.generate([chat_prompts[3]], GREEDY)[0]
    again = llm.generate([chat_prompts[3]], GREEDY)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_n_greater_than_one_shares_prompt_blocks(llm, chat_prompts):
    bm = llm.engine.block_manager
    hits0 = bm.hits
    res = llm.generate([chat_prompts[2] + [28]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))[0]
    assert len(res.outputs) == 3
    assert bm.hits - hits0 >= 2  # the two siblings reuse the first one's prompt blocks
    assert len({tuple(c.token_ids) for c in res.outputs}) >= 2


def test_seeded_sampling_is_reproducible(llm, chat_prompts):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123, max_tokens=16)
    a = llm.generate([chat_prompts[0]], p)[0].outputs[0].token_ids
    b = llm.generate([chat_prompts[0]], p)[0].outputs[0].token_ids
    assert a == b


def test_deterministic_mode_is_batch_invariant(chat_prompts):
    det = LLM(deterministic=True)
    p = SamplingParams(temperature=0.8, seed=7, max_tokens=16, logprobs=1)
    alone = det.generate([chat_prompts[1]], p)[0].outputs[0]
    crowd = det.generate(chat_prompts[:1] + [chat_prompts[1]] + chat_prompts[2:] * 3, p)[1].outputs[0]
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == alone.logprobs  # bitwise: same floats, not merely same argmax


def test_stop_strings_max_tokens_and_eos(llm, chat_prompts, reference):
    text = llm.tokenizer.decode(reference[0])
    word = text.split()[2]
    out = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=24, stop=[word]))[0].outputs[0]
    assert out.finish_reason == "stop" and word not in out.text and text.startswith(out.text)
    out = llm.generate([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    out = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_logprobs_are_normalized_and_include_sampled(llm, chat_prompts):
    import math

    out = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and len(lp) >= 5
        assert lp[tok] == max(lp.values())  # greedy picks the top token
        assert sum(math.exp(v) for v in lp.values()) <= 1.0 + 1e-4


def test_json_schema_output_is_valid(llm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    conv = [{"role": "user", "content": "Give me a JSON object for a person named Ann aged 31."}]
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=60,
                       structured=StructuredOutputParams(json_schema=schema))
    out = llm.chat([conv], p)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)
    choice = SamplingParams(temperature=1.0, seed=5, max_tokens=10,
                            structured=StructuredOutputParams(choice=["yes", "no", "maybe"]))
    assert llm.chat([[{"role": "user", "content": "Is the sky blue?"}]], choice)[0].outputs[0].text in {"yes", "no", "maybe"}


def test_bad_requests_raise_value_error(llm):
    eng = llm.engine
    with pytest.raises(ValueError):
        eng.add_request("x1", [], GREEDY)
    with pytest.raises(ValueError):
        eng.add_request("x2", [10**9], GREEDY)
    with pytest.raises(ValueError):
        eng.add_request("x3", [1, 2], SamplingParams(structured=StructuredOutputParams(regex="(unclosed")))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert not eng.has_unfinished_requests()


def test_abort_frees_blocks(llm, chat_prompts):
    eng = llm.engine
    free = eng.block_manager.num_free_blocks
    eng.add_request("abort-me", chat_prompts[0], SamplingParams(max_tokens=100))
    eng.step()
    assert eng.block_manager.num_free_blocks < free
    assert eng.abort_request("abort-me")
    assert eng.block_manager.num_free_blocks == free and not eng.has_unfinished_requests()


def test_structured_output_is_valid_under_async_scheduling():
    """Async scheduling builds step N+1 before step N's token is known: a grammar request's mask
    must still follow every token it emitted, next to grammar-free requests in the same batch."""
    import re

    llm = LLM(async_scheduling=True, max_num_seqs=8)
    eng, tok = llm.engine, llm.tokenizer
    pattern = "[0-9]{3}-[a-z]{4}-[0-9]{2}"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Give me a product code."}]))
    for s in range(4):
        eng.add_request(f"g{s}", prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                                                        structured=StructuredOutputParams(regex=pattern)))
        eng.add_request(f"f{s}", prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=24))
    text = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            text[out.request_id] = text.get(out.request_id, "") + out.new_text
    eng.close()
    for s in range(4):
        assert re.fullmatch(pattern, text[f"g{s}"]), text[f"g{s}"]
