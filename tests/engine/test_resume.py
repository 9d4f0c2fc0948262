"""Resume (engine/resume.py): a choice restarted from the tokens it produced elsewhere continues
exactly as the undisturbed run would: greedy, seeded sampling with penalties, n > 1 with a
finished choice left out, stop strings and text, a grammar; tokens that had already ended a choice
are refused, leaving nothing behind."""
from __future__ import annotations

import pytest

from moebus.engine.sampling import SamplingParams
from moebus.engine.sampling.structured import StructuredOutputParams


def _run(eng, rid, prompt, params, resume=None):
    """Per choice: (tokens, text, finish_reason) of everything the engine emitted for rid."""
    eng.add_request(rid, prompt, params, resume=resume)
    toks: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    reason: dict[int, str] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == rid and o.error is None
            toks.setdefault(o.index, []).extend(o.new_token_ids)
            text[o.index] = text.get(o.index, "") + (o.new_text or "")
            if o.finished:
                reason[o.index] = o.finish_reason
    return toks, text, reason


def _resumed(eng, rid, prompt, params, full, cut):
    """Run choice k from full[k][:cut[k]] and join the halves."""
    toks, text, reason = _run(eng, rid, prompt, params, resume={k: full[k][:c] for k, c in cut.items()})
    return {k: full[k][:c] + toks[k] for k, c in cut.items()}, text, reason


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True,
                   repetition_penalty=1.2, frequency_penalty=0.3),
], ids=["greedy", "seeded"])
def test_a_resumed_choice_continues_token_identically(llm, chat_prompts, params):
    eng = llm.engine
    prompt = chat_prompts[3]
    full, text, reason = _run(eng, "undisturbed", prompt, params)
    assert len(full[0]) >= 12
    for cut in (1, 7, len(full[0]) - 1):
        joined, rtext, rreason = _resumed(eng, f"resumed-{cut}", prompt, params, full, {0: cut})
        assert joined == full
        assert rreason == reason
        assert text[0].endswith(rtext[0]) and rtext[0]  # only the text after the cut, none of it twice


def test_n_choices_resume_only_the_open_ones(llm, chat_prompts):
    eng = llm.engine
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
    full, _, _ = _run(eng, "fan-full", chat_prompts[1], params)
    assert len({tuple(t) for t in full.values()}) > 1
    joined, _, reason = _resumed(eng, "fan-resumed", chat_prompts[1], params, full, {0: 4, 2: 9})
    assert joined == {0: full[0], 2: full[2]} and set(reason) == {0, 2}


def test_a_stop_string_spanning_the_cut_still_stops(llm, chat_prompts):
    eng = llm.engine
    prompt = chat_prompts[0]
    free, text, _ = _run(eng, "free", prompt, SamplingParams(temperature=0.0, max_tokens=20))
    stop = text[0][len(text[0]) // 2:][:6]  # a piece of the middle of the reply
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[stop])
    full, stext, sreason = _run(eng, "stopped", prompt, params)
    assert sreason == {0: "stop"} and stop not in stext[0]
    for cut in sorted({1, len(full[0]) // 2, len(full[0]) - 2, len(full[0]) - 1}):
        joined, rtext, rreason = _resumed(eng, f"stop-{cut}", prompt, params, full, {0: cut})
        assert joined == full and rreason == sreason
        assert stext[0].endswith(rtext[0])


def test_a_grammar_resumes_where_it_was(llm, chat_prompts):
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured=StructuredOutputParams(choice=["yes please", "no thank you"]))
    full, text, reason = _run(eng, "grammar", chat_prompts[2], params)
    assert text[0] in ("yes please", "no thank you") and reason == {0: "stop"}
    joined, _, _ = _resumed(eng, "grammar-resumed", chat_prompts[2], params, full, {0: 1})
    assert joined == full


@pytest.mark.parametrize("resume, match", [
    ({0: [1, 2]}, "already has"),  # max_tokens 2 reached
    ({1: [5]}, "choice 1"),
    ({}, "no choice"),
    ({0: [10**9]}, "vocabulary"),
])
def test_tokens_that_ended_the_choice_are_refused_and_leave_nothing(llm, chat_prompts, resume, match):
    eng = llm.engine
    with pytest.raises(ValueError, match=match):
        eng.add_request("refused", chat_prompts[0], SamplingParams(max_tokens=2), resume=resume)
    assert not eng.has_unfinished_requests() and "refused" not in {tr for tr in eng.tracked}
    eos = eng.tokenizer.eos_token_ids[0]
    with pytest.raises(ValueError, match="stopped"):
        eng.add_request("refused", chat_prompts[0], SamplingParams(max_tokens=9), resume={0: [5, eos]})
    assert not eng.has_unfinished_requests()
