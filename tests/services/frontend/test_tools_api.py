"""Function calling through the openai SDK on the toy stack: tools reach the template, a model's
Hermes-style calls come back as tool_calls (whole and streamed as deltas), tool_choice none /
named / parallel_tool_calls, and conversations with tool turns render."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moebus.devmodel.toy import ToyTokenizer
from moebus.shared.messages import ChatMessage, RenderRequest
from moebus.text.prompt_render import apply_template

from ..conftest import toy_stack

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture
async def calls_stack(nats_server):
    async with toy_stack(nats_server.url, engine={"reply": CALLS}) as s:
        yield s


async def test_auto_parses_hermes_calls_whole_and_streamed(calls_stack) -> None:
    c = calls_stack.client()
    r = await c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({t.id for t in choice.message.tool_calls}) == 2

    stream = await c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, max_tokens=200, stream=True)
    content, ids, names, args, finish, firsts = "", {}, {}, {}, None, []
    async for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a call's first delta: id, type and name, before any argument
                firsts.append(tc.index)
                assert tc.type == "function" and tc.function.name and not tc.function.arguments
                assert tc.index not in args
                ids[tc.index], names[tc.index] = tc.id, tc.function.name
            else:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Let me check.\n" and firsts == [0, 1]
    assert [(names[i], json.loads(args[i])) for i in (0, 1)] == calls


async def test_parallel_false_keeps_the_first_call_and_none_keeps_the_text(calls_stack) -> None:
    c = calls_stack.client()
    r = await c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, max_tokens=200,
                                        parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    r = await c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, max_tokens=200, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == CALLS
    assert r.choices[0].finish_reason == "stop"


async def test_a_cut_call_is_length_not_tool_calls(calls_stack) -> None:
    r = await calls_stack.client().chat.completions.create(model="toy", messages=ASK, tools=TOOLS, max_tokens=40)
    assert r.choices[0].finish_reason == "length"


async def test_named_choice_is_constrained_and_comes_back_as_its_call(stack) -> None:
    r = await stack.client().chat.completions.create(
        model="toy", messages=ASK, tools=TOOLS, max_tokens=50,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    # the toy answers a constrained request with its JSON: the constraint reached the engine
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"toy": True})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


async def test_histories_with_tool_turns_render(stack) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = await stack.client().chat.completions.create(model="toy", messages=history, tools=TOOLS, max_tokens=5)
    assert r.choices[0].message.content


async def test_tools_and_calls_reach_the_template() -> None:
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="assistant", tool_calls=[{"id": "c", "type": "function",
                                                       "function": {"name": "f", "arguments": {"a": 1}}}])]
    text = apply_template(ToyTokenizer(), RenderRequest(model="toy", messages=msgs, tools=[TOOLS[0]]),
                          [m.model_dump(exclude_none=True) for m in msgs])
    assert text.startswith("<|tools|>\n" + json.dumps([TOOLS[0]])) and '"arguments": {"a": 1}' in text


# SmolLM2-135M-Instruct's own template, as its GGUF carries it (tokenizer.chat_template)
SMOLLM2_GGUF_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt"
    " %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_the_shipped_smollm2_template_renders_tools_and_tool_turns() -> None:
    pytest.importorskip("torch")
    from moebus.text.tokenizer import Tokenizer, shipped_template

    tok = Tokenizer(None, [], chat_template=shipped_template("smollm2_tools"))
    own = Tokenizer(None, [], chat_template=SMOLLM2_GGUF_TEMPLATE)
    plain = [{"role": "user", "content": "hi"}]
    for conv in (plain, [{"role": "system", "content": "S"}, *plain, {"role": "assistant", "content": "a\n b"}],
                 [*plain, {"role": "assistant", "content": ""}, {"role": "user", "content": "more"}]):
        for prompt in (True, False):  # without tools: the GGUF's own text
            assert tok.apply_chat_template(conv, prompt) == own.apply_chat_template(conv, prompt)
    history = [*plain, {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "21 C"}]
    text = tok.apply_chat_template(history, tools=TOOLS)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


def test_a_chat_template_file_replaces_the_models(tmp_path) -> None:
    from moebus.services.cli import _tokenizer
    from moebus.services.launcher import Stack, StackConfig
    from moebus.services.tokenizer.service import load_tokenizer

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
                    "{% if tools %}{{ tools | map(attribute='function.name') | join(',') }}{% endif %}")
    tok = load_tokenizer("toy", str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS) == "[user:hi]get_weather,get_time"
    up = _tokenizer(SimpleNamespace(chat_template=str(path)))
    cfgs = dict(Stack(StackConfig(model="toy", tokenizer=up)).service_configs())
    assert cfgs["tokenizer"].chat_template == str(path.resolve())
    with pytest.raises(SystemExit):
        _tokenizer(SimpleNamespace(chat_template=str(tmp_path / "missing.jinja")))


@pytest.mark.parametrize("cls", ["hermes", "array"])
def test_parsers_give_the_same_calls_however_the_text_is_cut(cls: str) -> None:
    """Any split of the text into deltas: the same content and calls, the argument pieces adding up
    to each call's arguments, each call's start before its pieces."""
    import random

    from moebus.text.tool_parsers import CallArgs, CallArray, CallStart, HermesParser

    text = CALLS.replace('"Paris"', '"Pa\\"r}is]"') if cls == "hermes" else \
        '[{"name": "get_weather", "arguments": {"city": "Pa\\"r}is]", "n": [1, {"a": null}]}}, ' \
        '{"name": "get_time", "arguments": {}}]'
    rng, whole = random.Random(7), None
    for _ in range(50):
        p = HermesParser() if cls == "hermes" else CallArray()
        outs, i = [], 0
        while i < len(text):
            k = rng.randint(1, 9)
            outs += p.feed(text[i:i + k])
            i += k
        outs += p.finish()
        got = (p.content, [(c.name, json.loads(c.arguments), c.complete) for c in p.calls])
        whole = whole or got
        assert got == whole
        pieces: dict[int, str] = {}
        for o in outs:
            if isinstance(o, CallStart):
                assert o.index not in pieces
                pieces[o.index] = ""
            elif isinstance(o, CallArgs):
                pieces[o.index] += o.fragment
        assert [pieces[k] for k in sorted(pieces)] == [c.arguments for c in p.calls]
    assert [c[0] for c in whole[1]] == ["get_weather", "get_time"] and all(c[2] for c in whole[1])
    assert whole[1][0][1]["city"] == 'Pa"r}is]'


def test_every_stream_satisfies_the_protocol() -> None:
    from moebus.text.tool_parsers import PARSERS, CallArray, NamedCall, PlainText, ToolStream

    for make in (PlainText, NamedCall, CallArray, *PARSERS.values()):
        assert isinstance(make(), ToolStream)
