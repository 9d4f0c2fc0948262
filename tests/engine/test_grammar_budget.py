"""What following a grammar may cost each step (engine/structured_state.py): a request whose token
masks and accepts cost past the budget fails alone, a 400-class error naming its field, and the
requests beside it go on with the tokens they would have had. On SmolLM2.

The poison: nested stars around `.*` make xgrammar's Earley matcher keep ever more parse states,
so its mask costs grow steeply with every token; its compile is instant, so only the per-step budget can catch it."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.port import RequestRefused
from moebus.engine.sampling import SamplingParams, StructuredOutputParams

POISON_REGEX = "((.*)*)*x"
BUDGET_S = 0.05


@pytest.fixture(scope="module")
def engine(smol_dir) -> LLMEngine:
    # One intra-op thread: on a loaded box two threads' OpenMP barriers stall for seconds, which
    # would drown the figures (a worker sets its own, WorkerConfig.torch_threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = LLM(max_num_batched_tokens=512, grammar_mask_budget_s=BUDGET_S).engine
    yield eng
    eng.close()
    torch.set_num_threads(threads)


def _poison(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1, max_tokens=max_tokens,
                          structured=StructuredOutputParams(regex=POISON_REGEX, param="guided_regex"))


def _run(eng: LLMEngine, prompts: list[list[int]], poison: SamplingParams | None, others: int = 32) -> dict:
    """`others` tokens each (greedy) beside an optional poison: their tokens, o0's gaps between
    tokens, the poison's end."""
    for i, p in enumerate(prompts):
        eng.add_request(f"o{i}", p, SamplingParams(temperature=0.0, max_tokens=others, ignore_eos=True))
    if poison is not None:
        if (ready := eng.prepare(poison)) is not None:
            ready.result(120)  # compiled in the child process
        eng.add_request("poison", prompts[0], poison)
    tokens: dict[str, list[int]] = {}
    gaps, last, end = [], None, None
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_id == "o0" and o.new_token_ids:
                if last is not None:
                    gaps.append(now - last)
                last = now
            if o.request_id == "poison" and o.finished:
                end = o
    return {"tokens": tokens, "gaps": gaps, "poison": end}


def _figures(label: str, run: dict) -> str:
    g = sorted(run["gaps"])
    return (f"{label}: ITL p50 {1e3 * statistics.median(g):.0f} ms, p90 {1e3 * g[int(0.9 * (len(g) - 1))]:.0f} ms, "
            f"max {1e3 * g[-1]:.0f} ms over {len(g)} gaps, total {sum(g):.1f}s")


def test_a_grammar_too_costly_to_follow_fails_alone(engine, chat_prompts) -> None:
    prompts = chat_prompts[:3]
    alone = _run(engine, prompts, None)
    beside = _run(engine, prompts, _poison())
    end = beside["poison"]
    assert end is not None and end.finish_reason == "error" and not end.retryable
    assert end.error_param == "guided_regex" and "too ambiguous to serve" in end.error, end.error
    made = len(beside["tokens"].get("poison", []))
    assert made < 60, f"the poison ran {made} tokens before it was failed"
    for i in range(len(prompts)):  # the others never noticed: same tokens, all of them
        assert beside["tokens"][f"o{i}"] == alone["tokens"][f"o{i}"]
    assert not engine.has_unfinished_requests()
    print(f"\n{_figures('alone', alone)}\n{_figures('beside the poison', beside)}; poison failed after {made} "
          f"tokens: {end.error}")


def test_an_invalid_grammar_is_refused_before_admission_naming_its_field(engine, chat_prompts) -> None:
    params = SamplingParams(structured=StructuredOutputParams(regex="(a", param="structured_outputs.regex"))
    ready = engine.prepare(params)
    assert ready is not None
    with pytest.raises(RequestRefused, match="invalid regex") as e:
        ready.result(120)
    assert e.value.param == "structured_outputs.regex" and not e.value.retryable


@pytest.mark.slow
def test_itl_beside_a_poison_with_and_without_the_budget(engine, chat_prompts) -> None:
    """The figures for RELIABILITY.md: the others' ITL alone, beside the poison, and beside it with
    the budget off (the poison then runs as long as they do)."""
    prompts, n = chat_prompts[:3], 64
    lines = [_figures("alone", _run(engine, prompts, None, n))]
    beside = _run(engine, prompts, _poison(), n)
    lines.append(_figures("beside the poison, budget 50 ms", beside)
                 + f" (poison failed after {len(beside['tokens'].get('poison', []))} tokens)")
    cfg = engine.grammars.compiler.config
    try:
        cfg.mask_budget_s = 1e9
        unbounded = _run(engine, prompts, _poison(max_tokens=n), n)
    finally:
        cfg.mask_budget_s = BUDGET_S
    lines.append(_figures("beside the poison, no budget", unbounded))
    print("\n" + "\n".join(lines))
    assert statistics.median(beside["gaps"]) < statistics.median(unbounded["gaps"])
