"""Pathological output constraints against the real stack (SmolLM2, one worker, as `./run up`
runs it): each is served within a bound or refused with a 400 naming its field (compiling past the
deadline, invalid, or too costly to follow) — never a 5xx, a hang, or a worker stalled for the
stream beside it. Prints the witness stream's ITL alone, beside one poison regex, and beside the
whole corpus (RELIABILITY.md):
    .venv/bin/python -m pytest tests/services/test_structured_fuzz_stack.py -m slow -s

The corpus is what measured catastrophic for xgrammar 0.2.9 on this tokenizer (compile seconds on
one thread, mask milliseconds a step at token n), and what the issue named:
- compile: N optional properties (cubic: 1,000 ~2 s, 2,000 ~22 s, 3,000 > 60 s, in ~33 KB of
  JSON); bounded repetitions such as `.{1,60000}` (~2 s).
- masks: stars nested around `.*`, growing with the token n: `((.*)*)*x` ~1 ms at n=5, ~20 ms at
  16, ~60 ms at 23, ~140 ms at 30 (so at 24 tokens it sits on the 50 ms budget: served or refused);
  `(((.*)*)*)*x` ~50 ms at 16, ~150 ms at 23 (refused well within 24 tokens: the poison below);
  `(\\w+\\s?)*$` a flat ~30 ms (under the budget: served). Measured again 2026-12-07, one matcher
  in process (an earlier measure had `((.*)*)*x` at ~100 ms by n=20, and the test's poison was it).
- harmless for xgrammar though classic for backtracking engines: `(a+)+b`, `(a|a)*b`, `a{1000}`,
  long alternations, recursive and ambiguous EBNF, big enums and choices, deep schemas.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import openai
import pytest

from moebus.services.launcher import Stack

from .conftest import real_model_stack

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

DEADLINE_S = 2.0
ASK = [{"role": "user", "content": "Answer in the requested format."}]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _optional(n: int, value: dict) -> dict:
    return {"type": "object", "properties": {str(i): value for i in range(n)}}


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


# (field as the client sends it, its value, the `param` a 400 must name)
CORPUS: list[tuple[str, Any, str]] = [
    ("guided_json", _optional(3000, {}), "guided_json"),  # compiles for minutes
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": _optional(2000, {"type": "string"})}},
     "response_format"),
    ("guided_regex", ".{1,60000}", "guided_regex"),
    ("guided_regex", "((.*)*)*x", "guided_regex"),  # masks grow without bound
    ("structured_outputs", {"regex": "(((.*)*)*)*x"}, "structured_outputs.regex"),
    ("guided_regex", "((a|b|.)*)*x", "guided_regex"),
    ("guided_regex", "(\\w+\\s?)*$", "guided_regex"),
    ("guided_regex", "(a+)+b", "guided_regex"),
    ("guided_regex", "(a|a)*b", "guided_regex"),
    ("guided_regex", "a{1000}{1000}", "guided_regex"),  # invalid: two repetitions in a row
    ("guided_regex", "a{1000}", "guided_regex"),
    ("guided_regex", "(" + "|".join("a" * i for i in range(1, 200)) + ")*b", "guided_regex"),
    ("guided_regex", "(a", "guided_regex"),
    ("guided_grammar", 'root ::= e\ne ::= e "+" e | e "*" e | "(" e ")" | [0-9]+', "guided_grammar"),
    ("guided_grammar", 'root ::= a\na ::= a a | a a a | "x" | ""', "guided_grammar"),
    ("guided_grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(3000)), "guided_grammar"),
    ("guided_grammar", "root ::= ", "guided_grammar"),
    ("guided_json", {"type": "string", "enum": [f"value_{i}_x" for i in range(3000)]}, "guided_json"),
    ("guided_json", _nested(30), "guided_json"),
    ("guided_json", _nested(40), "guided_json"),  # deeper than the frontend's max_schema_depth
    ("guided_json", {"type": "nonsense"}, "guided_json"),
    ("guided_choice", [f"option number {i} " * 10 for i in range(200)], "guided_choice"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from real_model_stack(tmp_path_factory, workers=1, worker={"torch_threads": 1},
                                engine={"num_kv_blocks": 512, "max_num_seqs": 16,
                                        "grammar_compile_timeout_s": DEADLINE_S},
                                ready_timeout_s=180)


def _client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _witness(c: openai.AsyncOpenAI, stop: asyncio.Event, gaps: list[float]) -> int:
    """Greedy streams of 48 tokens, one after another until `stop`; the gaps between their chunks."""
    tokens = 0
    while not stop.is_set():
        stream = await c.chat.completions.create(model="smollm2", messages=STORY, max_tokens=48, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        last = None
        async for ch in stream:
            now = time.monotonic()
            if ch.choices and ch.choices[0].delta.content:
                if last is not None:
                    gaps.append(now - last)
                last = now
                tokens += 1
    return tokens


async def _ask(c: openai.AsyncOpenAI, field: str, value: Any) -> tuple[str, str, float]:
    """(outcome, detail, seconds): outcome "served", or "400:<param>"; anything else raises."""
    extra = {} if field == "response_format" else {field: value}
    kw = {"response_format": value} if field == "response_format" else {}
    started = time.monotonic()
    try:
        r = await c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=24, temperature=1.0, seed=3,
                                            extra_body=extra, **kw)
        return "served", repr(r.choices[0].message.content[:40]), time.monotonic() - started
    except openai.BadRequestError as e:
        return f"400:{e.body.get('param')}", e.body.get("message", "")[:120], time.monotonic() - started


def _itl(label: str, gaps: list[float]) -> str:
    g = sorted(gaps)
    return (f"{label}: ITL p50 {1e3 * statistics.median(g):.0f} ms, p90 {1e3 * g[int(0.9 * (len(g) - 1))]:.0f} ms, "
            f"max {1e3 * g[-1]:.0f} ms ({len(g)} gaps)")


async def _beside(c: openai.AsyncOpenAI, work) -> tuple[list[float], Any]:
    stop, gaps = asyncio.Event(), []
    witness = asyncio.create_task(_witness(c, stop, gaps))
    try:
        async with asyncio.timeout(60):
            while not gaps:  # the witness is decoding
                if witness.done():
                    await witness  # its error, if it failed
                    raise AssertionError("the witness stream ended before it decoded")
                await asyncio.sleep(0.05)
        result = await work
    finally:
        stop.set()
        await witness
    return gaps, result


async def test_every_pathological_constraint_is_served_or_a_400_and_the_stream_beside_goes_on(stack) -> None:
    c = _client(stack)
    await _ask(c, "guided_regex", "[0-9]+")  # the compile child's start, once
    alone, _ = await _beside(c, asyncio.sleep(6.0))  # the witness's own pace, the baseline
    poisoned, poison = await _beside(c, _ask(c, "guided_regex", "(((.*)*)*)*x"))

    async def corpus() -> list[tuple[str, str, float]]:
        return [await _ask(c, field, value) for field, value, _ in CORPUS]

    fuzzed, outcomes = await _beside(c, corpus())
    lines = [_itl("witness alone", alone), _itl("beside (((.*)*)*)*x", poisoned) + f" -> {poison[0]} in {poison[2]:.1f}s",
             _itl("beside the corpus", fuzzed)]
    lines += [f"  {o:<32} {s:5.1f}s  {f}={json.dumps(v)[:40]}: {d}" for (f, v, _), (o, d, s) in zip(CORPUS, outcomes, strict=True)]
    print("\n" + "\n".join(lines))
    assert poison[0] == "400:guided_regex"
    for (field, _, param), (outcome, detail, took) in zip(CORPUS, outcomes, strict=True):
        assert outcome in ("served", f"400:{param}"), (field, outcome, detail)
        assert took < 30, (field, took)
    refused_compiles = [d for _, d, _ in outcomes if "took longer than" in d]
    assert len(refused_compiles) >= 2  # the optional-property schemas
    for gaps in (poisoned, fuzzed):
        assert max(gaps) < 3.0 and statistics.median(gaps) < 3 * statistics.median(alone)
    assert (await _ask(c, "guided_regex", "[0-9]{3}"))[0] == "served"  # the worker still serves structured output
