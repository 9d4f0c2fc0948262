"""A chat conversation to prompt tokens: images encoded first (the template needs their token
counts), the template rendered by the tokenizer service (with the request's function tools), the
prompt checked against the context. Shared by chat completions, Responses and Anthropic Messages."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moebus.shared.messages import ChatMessage, ImageEmbedding, RenderRequest

from ..prompts.images import place

if TYPE_CHECKING:
    from ..service import FrontendService


@dataclass(slots=True)
class ChatPrompt:
    messages: list[ChatMessage]
    tools: list[dict] | None = None
    image_urls: list[str] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict = field(default_factory=dict)


async def render_chat(fe: FrontendService, model: str, p: ChatPrompt, max_tokens: int | None,
                      param: str = "messages") -> tuple[list[int], list[ImageEmbedding]]:
    """(prompt token ids, the images placed in it); 400 when it leaves no room for max_tokens."""
    render = RenderRequest(model=model, messages=p.messages, add_generation_prompt=p.add_generation_prompt,
                           continue_final_message=p.continue_final_message, chat_template_kwargs=p.template_kwargs,
                           tools=p.tools)
    encoded = None
    if p.image_urls:
        encoded = await fe.encode_images(model, p.image_urls)
        render.images, render.image_form = [im.num_tokens for im in encoded.images], encoded.form
    rendered = await fe.render(render)
    prompt = rendered.prompt_token_ids
    fe.check_context(len(prompt), max_tokens, param)
    return prompt, place(encoded.images, rendered.image_offsets) if encoded else []
