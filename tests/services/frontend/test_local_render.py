"""A frontend with `local_render` renders prompts itself: the same prompts, the same 400s, no
render call to the tokenizer service; what it cannot render (another model's) still goes there."""
from __future__ import annotations

import openai
import pytest

from moebus.devmodel.toy import ToyTokenizer
from moebus.services.frontend.config import LocalRender
from moebus.services.frontend.prompts.local_render import LocalRenderer
from moebus.shared.messages import ChatMessage, RenderRequest
from moebus.shared.tracing import Tracing
from moebus.text.prompt_render import PromptRenderer

from ..conftest import toy_stack

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
LOCAL = {"local_render": {"model": "toy"}}


def _renders(stack) -> float:
    return stack.tokenizer._renders._value.get()


async def test_local_and_bus_render_give_the_same_answers(nats_server) -> None:
    outs = {}
    for name, frontend in (("bus", {}), ("local", LOCAL)):
        async with toy_stack(nats_server.url, frontend=frontend) as s:
            client = s.client()
            chat = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=6, temperature=0)
            text = await client.completions.create(model="toy", prompt="abc", max_tokens=4, temperature=0)
            ids = await client.completions.create(model="toy", prompt=[70, 71, 72], max_tokens=4, temperature=0)
            outs[name] = (chat.choices[0].message.content, chat.usage.prompt_tokens, text.choices[0].text,
                          text.usage.prompt_tokens, ids.choices[0].text, _renders(s))
    assert outs["bus"][:-1] == outs["local"][:-1]
    assert outs["bus"][-1] == 2 and outs["local"][-1] == 0  # the text prompts (ids are only checked)


async def test_local_render_refuses_as_the_tokenizer_does(nats_server) -> None:
    frontend = {**LOCAL, "limits": {"max_model_len": 64}}
    async with toy_stack(nats_server.url, frontend=frontend) as s:
        client = s.client()
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "x" * 100}])
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            await client.completions.create(model="toy", prompt=[10**6], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="continue_final_message"):
            await client.chat.completions.create(model="toy", messages=[{"role": "assistant", "content": None}],
                                                 extra_body={"continue_final_message": True,
                                                             "add_generation_prompt": False})
        assert _renders(s) == 0


async def test_another_models_prompts_go_to_the_tokenizer_service() -> None:
    local = LocalRenderer("other", PromptRenderer(ToyTokenizer()), Tracing("test"))
    assert not local.serves(RenderRequest(model="toy", prompt="x"))
    assert local.serves(RenderRequest(model="other", prompt="x"))
    reply = await local.render(RenderRequest(model="other", messages=[ChatMessage(role="user", content="hi")]))
    assert ToyTokenizer().decode(reply.prompt_token_ids) == "<|user|>\nhi\n<|assistant|>\n"


async def test_a_tokenizer_that_does_not_load_leaves_rendering_to_the_service(tmp_path) -> None:
    missing = LocalRender(model="toy", chat_template=str(tmp_path / "missing.jinja"))
    assert await LocalRenderer.load(missing, Tracing("test")) is None
    assert await LocalRenderer.load(LocalRender(model="toy"), Tracing("test")) is not None


def test_moebus_up_lets_the_frontend_render_with_the_tokenizer_services_model_and_template(tmp_path) -> None:
    from moebus.services.launcher import Stack, StackConfig

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages | length }}")
    cfgs = dict(Stack(StackConfig(model="toy", served_model_name="t", tokenizer={"chat_template": str(path)}))
                .service_configs())
    assert cfgs["frontend"].local_render == LocalRender(model="toy", served_model_name="t", chat_template=str(path))
    assert cfgs["tokenizer"].chat_template == cfgs["frontend"].local_render.chat_template
    off = dict(Stack(StackConfig(model="toy", frontend={"local_render": None})).service_configs())
    assert off["frontend"].local_render is None
