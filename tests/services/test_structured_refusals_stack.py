"""A grammar the engine refuses reaches the client as a 400 naming the field it came from, and is
never moved to another worker: refused when prepared (compiling past the deadline: before any
token, so the HTTP status says it) or failed after some tokens (following it cost past the
budget: in-band in a stream). Toy stack, two workers; the toy engine plays the refusals the real
one makes (the real ones: tests/engine/test_grammar_budget.py, tests/sampling/test_compile_pool.py,
test_structured_fuzz.py)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import openai
import pytest

from moebus.devmodel.toy import ToyEngine, ToyEngineConfig, ToyOutput
from moebus.engine.port import RequestRefused

from .conftest import toy_stack

CHAT = [{"role": "user", "content": "hi"}]
SLOW_COMPILE, SLOW_MASK, COMPILES = "slow compile", "slow mask", "compiles"


class _Grammars(ToyEngine):
    """Regex SLOW_COMPILE is refused when prepared, COMPILES prepared fine (both settle 0.1 s later,
    from another thread, as the compile child's answer does); SLOW_MASK fails after its first token
    with the field at fault, as a grammar past its budget does."""

    def __init__(self) -> None:
        super().__init__(ToyEngineConfig(step_delay_s=0.002))
        self._costly: dict[str, str] = {}  # request id -> its constraint's field
        self._started: set[str] = set()
        self._compiled: set[str] = set()  # what a second prepare finds done

    def prepare(self, params: Any) -> Future[None] | None:
        s = params.structured
        if s is None or s.regex not in (SLOW_COMPILE, COMPILES) or s.regex in self._compiled:
            return None
        ready: Future[None] = Future()

        def settle() -> None:
            if s.regex == SLOW_COMPILE:
                ready.set_exception(RequestRefused("compiling the regex took longer than 3s", param=s.param))
            else:
                self._compiled.add(s.regex)
                ready.set_result(None)

        threading.Timer(0.1, settle).start()
        return ready

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, *a: Any, **kw: Any) -> None:
        super().add_request(request_id, prompt_token_ids, params, *a, **kw)
        if params.structured is not None and params.structured.regex == SLOW_MASK:
            self._costly[request_id] = params.structured.param

    def step(self) -> list[ToyOutput]:
        outs = super().step()
        for i, o in enumerate(outs):
            if o.request_id not in self._costly:
                continue
            if o.request_id not in self._started:  # its first token goes out
                self._started.add(o.request_id)
            else:
                self.abort_request(o.request_id)
                outs[i] = ToyOutput(o.request_id, [], True, "error", o.num_prompt_tokens,
                                    error="following the regex cost 120 ms a step: it is too ambiguous to serve",
                                    error_param=self._costly.pop(o.request_id))
        return outs


@pytest.fixture
async def stack(nats_server):
    async with toy_stack(nats_server.url, workers=2, engine_factory=_Grammars) as s:
        yield s


def _failed(stack) -> int:
    return sum(w.counters.get("failed", 0) for w in stack.workers)


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
async def test_past_the_compile_deadline_is_a_400_naming_the_field(stack, field: str) -> None:
    body = {"guided_regex": SLOW_COMPILE} if field == "guided_regex" else {"structured_outputs": {"regex": SLOW_COMPILE}}
    param = "guided_regex" if field == "guided_regex" else "structured_outputs.regex"
    c = stack.client()
    for stream in (False, True):  # before any token: the HTTP status says it, streamed or not
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=4, stream=stream, extra_body=body)
        assert e.value.body["param"] == param and "took longer than 3s" in e.value.body["message"]
    assert _failed(stack) == 2  # each on one worker only: never moved


async def test_a_grammar_past_its_budget_fails_alone_naming_the_field(stack) -> None:
    c = stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=8, extra_body={"guided_regex": SLOW_MASK})
    assert e.value.body["param"] == "guided_regex" and "too ambiguous" in e.value.body["message"]
    stream = await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=8, stream=True,
                                             extra_body={"guided_regex": SLOW_MASK})
    with pytest.raises(openai.APIError) as e:  # after the first token: in-band
        async for _ in stream:
            pass
    assert e.value.body["param"] == "guided_regex" and e.value.body["type"] == "invalid_request_error"
    ok = await c.chat.completions.create(model="toy", messages=CHAT, max_tokens=4, extra_body={"guided_regex": COMPILES})
    assert ok.choices[0].message.content  # prepared off the engine thread, then served
    assert _failed(stack) == 2  # each on one worker only: never moved
