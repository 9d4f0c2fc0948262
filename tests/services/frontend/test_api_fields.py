"""The vLLM/OpenAI request fields beyond the basics (docs/api.md): each one reaches the wire
SamplingOptions / the chat template, or is a 400 naming it, or (unknown) one warning line."""
from __future__ import annotations

import logging
from typing import Any

import openai
import pytest

from moebus.devmodel.toy import ToyEngine, ToyEngineConfig, ToyTokenizer
from moebus.services.frontend.schema.protocol import ChatCompletionRequest, CompletionRequest
from moebus.shared.errors import ServiceError
from moebus.shared.messages import RenderRequest, StructuredOptions
from moebus.text.prompt_render import apply_template

from ..conftest import toy_stack

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


class _Recording(ToyEngine):
    """The toy engine, keeping the prompt and the sampling options of each request it gets."""

    def __init__(self, seen: list[tuple[list[int], Any]]) -> None:
        super().__init__(ToyEngineConfig(step_delay_s=0.002))
        self.seen = seen

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, *a: Any, **kw: Any) -> None:
        if not request_id.startswith("warmup-"):  # the worker's own, before it is ready
            self.seen.append((list(prompt_token_ids), params))
        return super().add_request(request_id, prompt_token_ids, params, *a, **kw)


@pytest.fixture
async def rec(nats_server):
    seen: list[tuple[list[int], Any]] = []
    async with toy_stack(nats_server.url, engine_factory=lambda: _Recording(seen)) as stack:
        yield stack, seen


@pytest.mark.parametrize(("extra", "expected"), [  # each names the field it came from (errors about it do)
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOptions(json_schema=SCHEMA, param="structured_outputs.json")),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOptions(regex="a+", param="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["x", "y"]}},
     StructuredOptions(choice=["x", "y"], param="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOptions(grammar='root ::= "a"', param="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     StructuredOptions(json_object=True, param="structured_outputs.json_object")),
    ({"guided_json": SCHEMA}, StructuredOptions(json_schema=SCHEMA, param="guided_json")),
    ({"guided_json": '{"type": "object"}'}, StructuredOptions(json_schema={"type": "object"}, param="guided_json")),
    ({"guided_regex": "a+"}, StructuredOptions(regex="a+", param="guided_regex")),
    ({"guided_choice": ["x"]}, StructuredOptions(choice=["x"], param="guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOptions(grammar='root ::= "a"', param="guided_grammar")),
    ({"response_format": {"type": "json_object"}}, StructuredOptions(json_object=True, param="response_format")),
])
@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_every_form_of_constraint_maps_to_the_wire(cls: type, extra: dict, expected: StructuredOptions) -> None:
    body = {"messages": CHAT} if cls is ChatCompletionRequest else {"prompt": "hi"}
    assert cls.model_validate({"model": "toy", **body, **extra}).to_sampling().structured == expected


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["x"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is still true
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(stack, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


async def test_the_fields_reach_the_engine(rec) -> None:
    stack, seen = rec
    client = stack.client()
    await client.chat.completions.create(model="toy", messages=CHAT, max_completion_tokens=3, logit_bias={"5": -100},
                                         extra_body={"guided_regex": "[0-9]+"})
    await client.completions.create(model="toy", prompt="hi", max_tokens=2, logprobs=20,
                                    extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    (_, chat), (_, comp) = seen
    assert chat.max_tokens == 3 and chat.logit_bias == {5: -100.0} and chat.structured.regex == "[0-9]+"
    assert comp.logprobs == 20 and comp.structured.choice == ["a", "b"]


async def test_unknown_fields_are_named_in_one_warning(stack, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="moebus.services.frontend.schema.protocol"):
        r = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=2,
                                                         extra_body={"frobnicate": 1, "zap": {}, "store": False})
    assert r.choices[0].message.content
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert lines == ["The following fields were present in the request but ignored: ['frobnicate', 'zap']"]


async def test_continue_final_message_leaves_the_last_turn_open(rec) -> None:
    stack, seen = rec
    messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    await stack.client().chat.completions.create(model="toy", messages=messages, max_tokens=2, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=2,
                                                 extra_body={"add_generation_prompt": False})
    tok = ToyTokenizer()
    assert tok.decode(seen[0][0]) == "<|user|>\nhi\n<|assistant|>\nThe answer is"
    assert tok.decode(seen[1][0]) == "<|user|>\nhi\n"  # no generation prompt


class _KwTokenizer(ToyTokenizer):
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        return super().apply_chat_template(messages, add_generation_prompt) + repr(sorted(kw.items()))


def test_template_kwargs_and_reasoning_effort_reach_the_template() -> None:
    body = ChatCompletionRequest.model_validate({"model": "toy", "messages": CHAT, "reasoning_effort": "low",
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    req = RenderRequest(model="toy", messages=[], chat_template_kwargs=body.template_kwargs())
    text = apply_template(_KwTokenizer(), req, CHAT)
    assert text.endswith("[('enable_thinking', False), ('reasoning_effort', 'low')]")
    plain = RenderRequest(model="toy", messages=[])  # no kwargs: a template without them still works
    assert apply_template(ToyTokenizer(), plain, CHAT).endswith("<|assistant|>\n")
    gone = RenderRequest(model="toy", messages=[], continue_final_message=True, add_generation_prompt=False)
    with pytest.raises(ServiceError, match="continue_final_message"):
        apply_template(ToyTokenizer(), gone, [{"role": "assistant"}])


async def test_stop_reason_is_the_matched_stop_string(stack) -> None:
    client = stack.client()
    r = await client.chat.completions.create(model="toy", messages=CHAT, stop=["toy", "zzz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == "toy"
    r = await client.completions.create(model="toy", prompt="hi", max_tokens=100, stop=["Ünï"])
    assert r.choices[0].text.endswith("model. ") and r.choices[0].stop_reason == "Ünï"
    r = await client.completions.create(model="toy", prompt="hi", max_tokens=100)  # the toy's eos
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason is None
    last = [c async for c in await client.chat.completions.create(model="toy", messages=CHAT, stop=["toy"],
                                                                  stream=True) if c.choices][-1]
    assert last.choices[0].finish_reason == "stop" and last.choices[0].stop_reason == "toy"
