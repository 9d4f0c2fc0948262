"""POST /tokenize and /detokenize in vLLM's shapes, through the tokenizer service.

/tokenize takes a `prompt` (raw text) or chat `messages` (rendered through the chat template with
the same fields as chat completions) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`; /detokenize takes `tokens` and answers `{"prompt"}`. A prompt of `max_model_len`
tokens or more is a 400 `context_length_exceeded`, as for generation (so is a /detokenize of
that many ids; ids outside the vocabulary are a 400 too).
"""
from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import Field, ValidationInfo, field_validator, model_validator

from moebus.shared.messages import RenderRequest

from ..errors import APIError, bad_request
from ..keys import FRONTEND
from ..schema.body import parse_body
from ..schema.fields import ParamError, TokenId, _Req, limits_of
from ..schema.protocol import ChatTurn

MAX_TOKENS = 1 << 20  # ids in one /detokenize body (the body limit bounds it anyway)


class TokenizeRequest(_Req):
    model: str = Field(max_length=256)
    prompt: str | None = None
    messages: list[ChatTurn] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatTurn] | None, info: ValidationInfo) -> list[ChatTurn] | None:
        if v is not None and len(v) > (most := limits_of(info).max_messages):
            raise ValueError(f"at most {most} messages")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt or messages")
        if self.return_token_strs:
            raise ParamError("return_token_strs", "return_token_strs is not supported by this server")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message", "continue_final_message needs add_generation_prompt "
                             "set to false")
        return self


class DetokenizeBody(_Req):
    model: str = Field(max_length=256)
    tokens: list[TokenId] = Field(max_length=MAX_TOKENS)


async def tokenize(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    body = await parse_body(request, TokenizeRequest, fe.cfg.limits)
    fe.check_model(body.model)
    if body.messages is not None:
        urls: list[str] = []
        try:
            messages = [t.to_message(urls) for t in body.messages]
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        if urls:
            raise bad_request("/tokenize takes no image parts", param="messages")
        render = RenderRequest(model=body.model, messages=messages, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs or {})
    else:
        render = RenderRequest(model=body.model, prompt=body.prompt)
    ids = (await fe.render(render)).prompt_token_ids
    return web.json_response({"count": len(ids), "max_model_len": fe.cfg.limits.max_model_len, "tokens": ids,
                              "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND]
    body = await parse_body(request, DetokenizeBody, fe.cfg.limits)
    fe.check_model(body.model)
    if body.tokens:  # the ids must be in the vocabulary (the tokenizer checks them as a prompt)
        try:
            await fe.render(RenderRequest(model=body.model, prompt_token_ids=body.tokens))
        except APIError as e:
            e.param = "tokens" if e.param == "prompt" else e.param
            raise
    return web.json_response({"prompt": await fe.detokenize_all(body.model, body.tokens)})

