"""The OpenAI-compatible API on the toy stack, driven with the real `openai` SDK."""
from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from moebus.devmodel.toy import TOY_JSON, TOY_REPLY

from ..conftest import ToyStack, toy_stack

CHAT = [{"role": "user", "content": "hi"}]


async def test_chat_non_stream(stack: ToyStack) -> None:
    r = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=200)
    assert r.object == "chat.completion" and r.model == "toy"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TOY_REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(TOY_REPLY.encode()) + 1  # bytes + EOS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_stream_with_usage(stack: ToyStack) -> None:
    stream = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=10, stream=True,
                                                          stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TOY_REPLY.encode()[:10].decode()
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


async def test_stop_string_across_token_boundaries(stack: ToyStack) -> None:
    # "日本" is 6 byte-tokens in the toy vocabulary: the match spans many tokens.
    client = stack.client()
    r = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200, stop=["日本", "zzz"])
    assert r.choices[0].message.content == TOY_REPLY.split("日本")[0]
    assert r.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200, stop="toy m",
                                                  stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == TOY_REPLY.split("toy m")[0]
    await stack.wait_idle()  # the worker was told to stop (abort) and freed its blocks


async def test_n_choices_seed_and_sampling_params(stack: ToyStack) -> None:
    r = await stack.client().chat.completions.create(
        model="toy", messages=CHAT, n=3, max_tokens=5, temperature=0.7, top_p=0.9, seed=1, presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"top_k": 20})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello" for c in r.choices)
    assert r.usage.completion_tokens == 15


async def test_chat_logprobs(stack: ToyStack) -> None:
    r = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=3, logprobs=True,
                                                     top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "e", "l"]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert content[0].bytes == [72]


async def test_response_format_json(stack: ToyStack) -> None:
    client = stack.client()
    r = await client.chat.completions.create(model="toy", messages=CHAT, response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == json.loads(TOY_JSON)
    schema = {"type": "object", "properties": {"toy": {"type": "boolean"}}, "required": ["toy"]}
    r = await client.chat.completions.create(model="toy", messages=CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert json.loads(r.choices[0].message.content) == {"toy": True}


async def test_completions(stack: ToyStack) -> None:
    client = stack.client()
    r = await client.completions.create(model="toy", prompt=["a", "b"], n=2, max_tokens=4, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["aHell", "aHell", "bHell", "bHell"]
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 16
    r = await client.completions.create(model="toy", prompt="a", max_tokens=4, logprobs=1)
    assert r.choices[0].logprobs.tokens == ["H", "e", "l", "l"] and r.choices[0].logprobs.text_offset[0] == 0
    r = await client.completions.create(model="toy", prompt=[100, 101], max_tokens=2)  # token ids
    assert r.choices[0].text == "He"
    stream = await client.completions.create(model="toy", prompt="x", max_tokens=5, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert chunks[-1].usage.completion_tokens == 5


async def test_models_health_metrics_openapi(stack: ToyStack) -> None:
    models = await stack.client().models.list()
    assert [m.id for m in models.data] == ["toy"]
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.base_url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
        async with http.get(stack.base_url + "/metrics") as r:
            text = await r.text()
            assert 'moebus_frontend_http_requests_total{route="/v1/chat/completions",status="200"}' in text
            assert "moebus_frontend_time_to_first_token_seconds_bucket" in text
        async with http.get(stack.base_url + "/openapi.json") as r:
            doc = await r.json()
            assert "/v1/chat/completions" in doc["paths"]
            assert "ChatCompletionRequest" in doc["components"]["schemas"]


async def raw_post(stack: ToyStack, path: str, data: bytes | str, headers: dict | None = None):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + path, data=data, headers=headers or {}) as r:
            return r.status, await r.json(), r.headers


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "toy"}, 400, "messages"),  # missing messages
    ({"model": "toy", "messages": []}, 400, "messages"),
    ({"model": "toy", "messages": CHAT, "temperature": 3}, 400, "temperature"),
    ({"model": "toy", "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ({"model": "toy", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "toy", "messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs"),  # needs logprobs
    ({"model": "toy", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "toy", "messages": CHAT, "n": 99}, 400, "n"),
    ({"model": "nope", "messages": CHAT}, 404, "model"),
])
async def test_bad_requests_get_openai_errors(stack: ToyStack, body: dict, status: int, param: str | None) -> None:
    code, payload, _ = await raw_post(stack, "/v1/chat/completions", json.dumps(body))
    assert code == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


async def test_malformed_json_and_unknown_route(stack: ToyStack) -> None:
    status, payload, _ = await raw_post(stack, "/v1/chat/completions", '{"model": ')
    assert status == 400 and payload["error"]["code"] == "invalid_json"
    status, payload, _ = await raw_post(stack, "/v1/nothing", "{}")
    assert status == 404 and payload["error"]["type"] == "invalid_request_error"


async def test_sdk_raises_typed_errors(stack: ToyStack) -> None:
    client = stack.client()
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="toy", messages=CHAT, temperature=-1)


async def test_api_keys(nats_server) -> None:
    async with toy_stack(nats_server.url, frontend={"api_keys": ["sk-good"]}) as stack:
        with pytest.raises(openai.AuthenticationError) as e:
            await stack.client("sk-bad").chat.completions.create(model="toy", messages=CHAT)
        assert e.value.body["code"] == "invalid_api_key"
        r = await stack.client("sk-good").chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
        assert r.choices[0].message.content == "He"
        async with aiohttp.ClientSession() as http:  # probes stay open
            async with http.get(stack.base_url + "/health") as r:
                assert r.status == 200


async def test_prompt_too_long_is_a_400_even_when_streaming(stack: ToyStack) -> None:
    client = stack.client()
    long = [{"role": "user", "content": "x" * 3000}]  # the toy engine's max_model_len is 2048 tokens
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="toy", messages=long)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="toy", messages=long, stream=True)
    assert (await client.models.retrieve("toy")).id == "toy"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
