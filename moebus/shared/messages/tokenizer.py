"""Tokenizer service messages: prompt rendering and stateless incremental detokenization."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..codec import Message
from .encoder import ImagePromptForm


class ContentPart(Message):
    """A piece of a message: text, or the next image of the request (RenderRequest.images)."""

    type: Literal["text", "image"] = "text"
    text: str | None = None


class ChatMessage(Message):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's function calls ({"id", "type", "function": {"name", "arguments"}}, the
    # arguments as an object where they parse) and a tool turn's answer to one: for the template.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (templates that render it)


class RenderRequest(Message):
    """Exactly one of chat `messages` (rendered through the chat template), a raw `prompt`, or
    `prompt_token_ids` (checked against the vocabulary and given back).

    `max_prompt_tokens` (the frontend sends its max_model_len): a prompt of that many tokens or
    more is refused with PROMPT_TOO_LONG instead of a reply too large for the bus.
    """

    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    # Render the last message open: no generation prompt, its end of turn cut off (the model goes on).
    continue_final_message: bool = False
    chat_template_kwargs: dict = {}  # extra variables for the chat template
    tools: list[dict] | None = None  # function tools ({"type": "function", "function": {...}}) for the template
    max_prompt_tokens: int | None = Field(None, ge=1)
    # Chat with images: each image part becomes image_form's prefix, placeholder x n, suffix, where
    # n is its entry here (the encoder's token count for that image), in order of appearance.
    images: list[int] = []
    image_form: ImagePromptForm | None = None

    @model_validator(mode="after")
    def _one_input(self) -> RenderRequest:
        if sum(x is not None for x in (self.messages, self.prompt, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of messages, prompt or prompt_token_ids")
        return self


class RenderReply(Message):
    prompt_token_ids: list[int]
    prompt_text: str | None = None
    eos_token_ids: list[int] = []
    image_offsets: list[int] = []  # prompt position of each image's first placeholder


class DetokenizeRequest(Message):
    """One step of incremental detokenization; the caller keeps the (small) state.

    `token_ids` is the caller's window: ids from its prefix offset on; the first `read_offset` of
    them were already turned into text (they give the decoder its left context). `held` is text
    withheld because it may be the start of a stop string.
    """

    model: str
    token_ids: list[int]
    read_offset: int = 0
    held: str = ""
    stop: list[str] = []
    include_stop: bool = False
    finished: bool = False  # last step: release whatever is held


class DetokenizeReply(Message):
    text: str = ""  # released to the client
    held: str = ""
    prefix_offset: int = 0  # new offsets, relative to the request's window
    read_offset: int = 0
    stopped: bool = False  # a stop string matched: the choice is finished
    stop_reason: str | None = None  # which one
