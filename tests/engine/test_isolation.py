"""Fault injection: a request whose own state raises fails alone, at every point of a step, and the
engine keeps serving the others with unchanged (greedy) output. A step that fails with nobody to
blame fails the requests it held, retryably, and the engine goes on."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from moebus.engine.llm import LLM
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams, StructuredOutputParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
POISON = "poison"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request) -> LLMEngine:
    eng = LLM(max_num_batched_tokens=512, async_scheduling=request.param).engine
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(llm, chat_prompts) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in chat_prompts]


def _run(eng: LLMEngine, prompts: list[list[int]], poison_params: SamplingParams,
         inject: Callable[[LLMEngine], None]) -> tuple[dict[str, list[int]], dict[str, tuple[str | None, str | None]]]:
    """The prompts as greedy requests r0.., plus the poison request (first prompt), with the fault
    injected after it was added; run to the end. Returns tokens and (finish_reason, error) per id."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    eng.add_request(POISON, prompts[0], poison_params)
    inject(eng)
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple[str | None, str | None]] = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == len(eng.block_manager.blocks)  # nothing leaked
    return tokens, ends


def _check(engine: LLMEngine, prompts, reference, params, inject, stage: str) -> None:
    tokens, ends = _run(engine, prompts, params, inject)
    reason, error = ends[POISON]
    assert reason == "error" and stage in error, ends[POISON]
    for i in range(len(prompts)):
        assert ends[f"r{i}"][0] in ("stop", "length") and tokens[f"r{i}"] == reference[i], i
    # ... and the engine serves the next request as if nothing happened
    tokens, ends = _run(engine, prompts[:1], GREEDY, lambda eng: None)
    assert tokens["r0"] == reference[0] and tokens[POISON] == reference[0]


def _req(eng: LLMEngine, rid: str = POISON):
    return eng.tracked[rid].req


def test_poison_parameters_fail_alone_in_sampling(engine, chat_prompts, reference):
    """The issue's poison (min_tokens = 2**63, past validation) overflows the sampling batch."""
    def inject(eng):
        _req(eng).params.min_tokens = 2**63

    _check(engine, chat_prompts, reference, SamplingParams(temperature=0.0, max_tokens=12), inject, "sampling")


def test_scheduling_fault_fails_alone(engine, chat_prompts, reference):
    def inject(eng):
        bm = eng.block_manager
        real = bm.match_prefix

        def match_prefix(req):
            if req.request_id == POISON:
                del bm.match_prefix  # one shot: the follow-up request of that id is clean
                raise RuntimeError("injected scheduling fault")
            return real(req)
        bm.match_prefix = match_prefix

    _check(engine, chat_prompts, reference, GREEDY, inject, "scheduling")


def test_grammar_mask_fault_fails_alone(engine, chat_prompts, reference):
    def inject(eng):
        _req(eng).grammar.matcher = object()  # xgrammar's batch fill raises on it

    params = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutputParams(json_object=True))
    _check(engine, chat_prompts, reference, params, inject, "grammar mask")


def test_grammar_accept_fault_fails_alone(engine, chat_prompts, reference):
    def inject(eng):
        def accept_token(_t):
            raise RuntimeError("injected grammar fault")
        _req(eng).grammar.accept_token = accept_token

    params = SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutputParams(json_object=True))
    _check(engine, chat_prompts, reference, params, inject, "post-processing")


def test_detokenizer_fault_fails_alone(engine, chat_prompts, reference):
    def inject(eng):
        def push(_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        eng.tracked[POISON].detok.push = push

    _check(engine, chat_prompts, reference, GREEDY, inject, "post-processing")


def test_add_fault_leaves_nothing_behind(engine, chat_prompts, reference):
    real = engine.tokenizer.detokenizer
    engine.tokenizer.detokenizer = lambda ids: (_ for _ in ()).throw(RuntimeError("injected add fault"))
    try:
        with pytest.raises(RuntimeError):
            engine.add_request(POISON, chat_prompts[0], GREEDY)
    finally:
        engine.tokenizer.detokenizer = real
    assert POISON not in engine.tracked and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request(POISON, chat_prompts[0], SamplingParams(min_tokens=2**63))
    tokens, _ = _run(engine, chat_prompts[:1], GREEDY, lambda eng: None)
    assert tokens["r0"] == reference[0]


def test_step_failure_with_nobody_to_blame_fails_the_step_retryably(engine, chat_prompts, reference):
    model = engine.runner.model
    real = model.forward
    calls = {"n": 0}

    def forward(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # mid-generation: the requests have emitted tokens already
            raise RuntimeError("injected model fault")
        return real(*a, **kw)

    model.forward = forward
    try:
        for i, p in enumerate(chat_prompts):
            engine.add_request(f"r{i}", p, GREEDY)
        ends = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    ends[out.request_id] = out
    finally:
        del model.forward
    assert all(o.finish_reason == "error" and o.retryable and "injected model fault" in o.error
               for o in ends.values()), ends
    assert engine.failed_steps_in_a_row == 1
    tokens, _ = _run(engine, chat_prompts[:1], GREEDY, lambda eng: None)
    assert tokens["r0"] == reference[0] and engine.failed_steps_in_a_row == 0
