"""#19 item 3 on a running stack: continuous usage in streams, echo with token-id prompts, echo with
logprobs refused by name, chat_template_kwargs / reasoning_effort reaching a template file, and the
max_tokens-past-the-context cap (a 400, never a clip)."""
from __future__ import annotations

from typing import Any

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY, ToyEngine, ToyEngineConfig, ToyTokenizer

from .conftest import toy_stack

CHAT = [{"role": "user", "content": "hi"}]
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "effort={{ reasoning_effort | default('none') }} thinking={{ enable_thinking | default('unset') }}\n")


async def test_continuous_usage_on_every_chunk(stack) -> None:
    client = stack.client()
    chunks = [c async for c in await client.chat.completions.create(
        model="toy", messages=CHAT, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[0] <= 1 and counts[-1] == 6  # grows with the text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6
    comp = [c async for c in await client.completions.create(
        model="toy", prompt="hi", max_tokens=4, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert [c.usage.completion_tokens for c in comp if c.choices][-1] == 4
    plain = [c async for c in await client.chat.completions.create(  # without it: the last chunk only
        model="toy", messages=CHAT, max_tokens=3, stream=True, stream_options={"include_usage": True})]
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


async def test_echo_with_token_id_prompts(stack) -> None:
    ids = ToyTokenizer().encode("héllo ")
    client = stack.client()
    r = await client.completions.create(model="toy", prompt=ids, max_tokens=5, echo=True)
    assert r.choices[0].text == "héllo " + TOY_REPLY[:5]
    stream = await client.completions.create(model="toy", prompt=[ids, ids], max_tokens=3, echo=True, stream=True)
    texts: dict[int, str] = {}
    async for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: "héllo " + TOY_REPLY[:3], 1: "héllo " + TOY_REPLY[:3]}


async def test_echo_with_logprobs_is_a_400_naming_echo(stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await stack.client().completions.create(model="toy", prompt="hi", max_tokens=2, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo" and "prompt's logprobs" in e.value.body["message"]


async def test_logprobs_up_to_20(stack) -> None:
    r = await stack.client().chat.completions.create(model="toy", messages=CHAT, max_tokens=3, logprobs=True,
                                                     top_logprobs=20)
    assert [len(t.top_logprobs) for t in r.choices[0].logprobs.content] == [20, 20, 20]
    r = await stack.client().completions.create(model="toy", prompt="hi", max_tokens=2, logprobs=20)
    assert [len(t) for t in r.choices[0].logprobs.top_logprobs] == [20, 20]


async def test_max_tokens_past_the_context_is_a_400(stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens over max_model_len (8192)
        await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=8190)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens alone over it: validation names the field
        await client.completions.create(model="toy", prompt="hi", max_tokens=9000)
    assert e.value.body["param"] == "max_tokens"


class _Recording(ToyEngine):
    def __init__(self, seen: list[list[int]]) -> None:
        super().__init__(ToyEngineConfig(step_delay_s=0.002))
        self.seen = seen

    def add_request(self, request_id: str, prompt_token_ids: list[int], *a: Any, **kw: Any) -> None:
        if not request_id.startswith("warmup-"):
            self.seen.append(list(prompt_token_ids))
        return super().add_request(request_id, prompt_token_ids, *a, **kw)


async def test_template_kwargs_and_reasoning_effort_reach_the_template(nats_server, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    seen: list[list[int]] = []
    async with toy_stack(nats_server.url, tokenizer={"chat_template": str(path)},
                         engine_factory=lambda: _Recording(seen)) as stack:
        client = stack.client()
        await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=2, reasoning_effort="low",
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
    tok = ToyTokenizer()
    assert tok.decode(seen[0]) == "[user] hi\neffort=low thinking=False"
    assert tok.decode(seen[1]) == "[user] hi\neffort=none thinking=unset"
