"""/v1/responses through the openai SDK and /v1/messages (+ count_tokens) through the anthropic
SDK, on the toy stack: bodies, the streams' events as the SDKs consume them, function tools."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY

from ..conftest import toy_stack
from .test_tools_api import CALLS

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
           {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
A_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
           {"name": "get_time", "input_schema": {"type": "object"}}]


def claude(stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.base_url, api_key="none", max_retries=0)


@pytest.fixture
async def calls_stack(nats_server):
    async with toy_stack(nats_server.url, engine={"reply": CALLS}) as s:
        yield s


async def test_responses_text_whole_and_streamed(stack) -> None:
    c = stack.client()
    r = await c.responses.create(model="toy", input="hi", instructions="Be brief.", max_output_tokens=200)
    assert r.status == "completed" and r.output_text == TOY_REPLY and r.output[0].type == "message"
    assert r.usage.output_tokens == len(TOY_REPLY.encode()) + 1 and r.usage.input_tokens > 0
    cut = await c.responses.create(model="toy", input=[{"role": "user", "content": "hi"}], max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"

    kinds, text = [], ""
    async with c.responses.stream(model="toy", input="hi", max_output_tokens=200) as stream:
        async for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        final = await stream.get_final_response()
    assert text == TOY_REPLY == final.output_text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


async def test_responses_function_calls_and_tool_outputs(calls_stack) -> None:
    c = calls_stack.client()
    r = await c.responses.create(model="toy", input="Weather in Paris?", tools=R_TOOLS, max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(o.name, json.loads(o.arguments)) for o in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_time", {"tz": "CET"})]
    args: dict[str, str] = {}
    async with c.responses.stream(model="toy", input="Weather in Paris?", tools=R_TOOLS,
                                  max_output_tokens=200) as stream:
        async for ev in stream:
            if ev.type == "response.function_call_arguments.delta":
                args[ev.item_id] = args.get(ev.item_id, "") + ev.delta
        final = await stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [args[o.id] for o in streamed] == [o.arguments for o in streamed] == [o.arguments for o in calls]
    # the calls and their outputs go back as input items
    follow = await c.responses.create(model="toy", tools=R_TOOLS, tool_choice="none", max_output_tokens=300, input=[
        {"role": "user", "content": "Weather in Paris?"},
        *({"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments} for o in calls),
        *({"type": "function_call_output", "call_id": o.call_id, "output": "21 C"} for o in calls)])
    assert follow.status == "completed" and not any(o.type == "function_call" for o in follow.output)


@pytest.mark.parametrize(("extra", "param"), [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                              ({"store": True}, "store"),
                                              ({"tool_choice": "required"}, "tool_choice"),
                                              ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
                                              ({"input": []}, "input")])
async def test_responses_what_it_cannot_do_is_a_400(stack, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await stack.client().responses.create(model="toy", **{"input": "hi", **extra})
    assert e.value.body["param"] == param


async def test_messages_text_stop_sequence_and_stream(stack) -> None:
    c = claude(stack)
    m = await c.messages.create(model="toy", max_tokens=200, system="Be brief.",
                                messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text == TOY_REPLY and m.stop_reason == "end_turn" and m.usage.input_tokens > 0
    m = await c.messages.create(model="toy", max_tokens=200, stop_sequences=["toy"],
                                messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert m.content[0].text == "Hello from the " and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "toy")
    m = await c.messages.create(model="toy", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    async with c.messages.stream(model="toy", max_tokens=200, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text == TOY_REPLY == final.content[0].text and final.stop_reason == "end_turn"
    n = await c.messages.count_tokens(model="toy", messages=[{"role": "user", "content": "hi"}])
    assert n.input_tokens == final.usage.input_tokens


async def test_messages_tools_whole_streamed_and_results(calls_stack) -> None:
    c = claude(calls_stack)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = await c.messages.create(model="toy", max_tokens=200, tools=A_TOOLS, messages=ask)
    assert m.stop_reason == "tool_use" and m.content[0].text == "Let me check.\n"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in uses] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(b.id.startswith("toolu_") for b in uses)
    async with c.messages.stream(model="toy", max_tokens=200, tools=A_TOOLS, messages=ask) as s:
        partial = {}
        async for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial[ev.index] = partial.get(ev.index, "") + ev.delta.partial_json
        final = await s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in uses]
    assert [json.loads(v) for v in partial.values()] == [b.input for b in uses]
    one = await c.messages.create(model="toy", max_tokens=200, tools=A_TOOLS, messages=ask,
                                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in one.content if b.type == "tool_use"] == ["get_weather"]
    follow = await c.messages.create(model="toy", max_tokens=300, tools=A_TOOLS, tool_choice={"type": "none"},
                                     messages=[*ask, {"role": "assistant", "content": m.content},
                                               {"role": "user", "content": [
                                                   {"type": "tool_result", "tool_use_id": b.id, "content": "21 C"}
                                                   for b in uses]}])
    assert follow.stop_reason == "end_turn"


async def test_messages_errors_in_anthropics_shape(stack) -> None:
    c = claude(stack)
    with pytest.raises(anthropic.BadRequestError) as e:
        await c.messages.create(model="toy", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                tool_choice={"type": "tool", "name": "nope"}, tools=A_TOOLS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):  # found by fuzzing: was a 500
        await c.messages.create(model="toy", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                tools=[{"name": "bad name", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.BadRequestError) as e:
        await c.messages.create(model="toy", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        await c.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


async def test_messages_take_the_key_as_x_api_key(nats_server) -> None:
    async with toy_stack(nats_server.url, frontend={"api_keys": ["sk-right"]}) as s:
        ask = {"model": "toy", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        ok = anthropic.AsyncAnthropic(base_url=s.base_url, api_key="sk-right", max_retries=0)
        assert (await ok.messages.create(**ask)).usage.output_tokens == 3
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic.AsyncAnthropic(base_url=s.base_url, api_key="sk-wrong", max_retries=0).messages.create(**ask)
