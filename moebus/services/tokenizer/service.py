"""TokenizerService: queue-grouped `render` and `detokenize` endpoints over NATS."""
from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg

from moebus.shared.deepseek_v4 import recipe_version
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import DetokenizeReply, DetokenizeRequest, RenderReply, RenderRequest
from moebus.shared.service import Service
from moebus.shared.subjects import Queues
from moebus.shared.tracing import Attr, annotate
from moebus.text.detokenizer import decode_step
from moebus.text.prompt_render import INLINE_CHARS, PromptRenderer, check_length, flatten, new_marker
from moebus.text.stop_strings import apply_stops, matched_stop

from .config import TokenizerConfig
from .recipe import Recipe, RecipeError, v4_tokenizer_json


def load_tokenizer(model: str, chat_template_file: str | None = None) -> Any:
    from moebus.text.serving_tokenizer import load_serving_tokenizer  # tokenizers, jinja2: loaded in setup

    return load_serving_tokenizer(model, chat_template_file)


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(self, cfg: TokenizerConfig, tokenizer: Any = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: TokenizerConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self.tok = tokenizer
        self._skip: frozenset[int] = frozenset()
        self.renderer: PromptRenderer | None = None  # chat templates, prompts, token ids (moebus/text/prompt_render.py)
        self.recipe: Recipe | None = None  # DeepSeek-V4: conversations render through deepseek-recipe
        self._renders = self.metrics.counter("renders_total", "Prompts rendered")
        self._prompt_tokens = self.metrics.counter("prompt_tokens_total", "Prompt tokens encoded")

    @property
    def ready(self) -> bool:
        return self.tok is not None

    def model(self) -> str | None:
        return self.served_model

    async def setup(self) -> None:
        if self.tok is None:
            self.tok = await asyncio.to_thread(load_tokenizer, self.cfg.model, self.cfg.chat_template)
        if self.cfg.chat_template is None and (version := recipe_version(self.cfg.model)) is not None:
            self.recipe = await asyncio.to_thread(Recipe, version, v4_tokenizer_json(self.cfg.model))
        specials = (getattr(self.tok, "all_special_ids", None) or getattr(self.tok, "special_ids", None)
                    or self.tok.eos_token_ids)
        self._skip = frozenset(specials)
        self.renderer = PromptRenderer(self.tok)
        s = self.subjects
        await self.bus.subscribe(s.tokenizer_render, RenderRequest, self.render, queue=Queues.TOKENIZER,
                                 endpoint="render")
        await self.bus.subscribe(s.tokenizer_detokenize, DetokenizeRequest, self.detokenize,  # a call per chunk:
                                 queue=Queues.TOKENIZER, endpoint="detokenize", traced=False)  # no span per token

    def _check_model(self, model: str) -> None:
        if model != self.served_model:
            raise ServiceError(ErrorCode.NOT_FOUND, f"tokenizer serves {self.served_model!r}, not {model!r}",
                               param="model")

    async def render(self, req: RenderRequest, _: Msg) -> RenderReply:
        self._check_model(req.model)
        if req.messages is not None and self.recipe is not None:
            text, ids = await self._render_recipe(req)
            check_length(req, len(ids))
            reply = RenderReply(prompt_token_ids=ids, prompt_text=text, eos_token_ids=list(self.tok.eos_token_ids))
        else:
            reply = await self.renderer.render(req)
        if req.prompt_token_ids is not None:
            return reply
        n = len(reply.prompt_token_ids)
        self._renders.inc()
        self._prompt_tokens.inc(n)
        annotate({Attr.MODEL: req.model, Attr.INPUT_TOKENS: n, "moebus.images": len(req.images),
                  "moebus.chat": req.messages is not None})
        return reply

    async def _render_recipe(self, req: RenderRequest) -> tuple[str, list[int]]:
        """(prompt text, ids) of a V4 conversation, rendered and encoded by deepseek-recipe."""
        if req.images:
            raise ServiceError(ErrorCode.BAD_REQUEST, "images are not supported for this model", param="messages")
        if not req.add_generation_prompt and not req.continue_final_message:
            raise ServiceError(ErrorCode.BAD_REQUEST, "DeepSeek-V4 prompts always open the assistant turn: "
                               "add_generation_prompt false needs continue_final_message", param="messages")
        messages, _ = flatten(req.messages or [], new_marker())
        try:
            conv = self.recipe.conversation(messages, req.tools, req.chat_template_kwargs, req.continue_final_message)
        except RecipeError as e:
            raise ServiceError(ErrorCode.BAD_REQUEST, f"chat template: {e}", param="messages") from None
        text = self.recipe.render(conv)
        ids = await asyncio.to_thread(self.recipe.encode, conv) if len(text) > INLINE_CHARS else self.recipe.encode(conv)
        return text, ids

    async def detokenize(self, req: DetokenizeRequest, _: Msg) -> DetokenizeReply:
        self._check_model(req.model)
        delta, prefix, read = decode_step(self.tok, req.token_ids, req.read_offset, self._skip, req.finished)
        text, held, stopped = apply_stops(req.held, delta, req.stop, include_stop=req.include_stop,
                                          finished=req.finished)
        return DetokenizeReply(text=text, held=held, prefix_offset=prefix, read_offset=read, stopped=stopped,
                               stop_reason=matched_stop(req.held + delta, req.stop) if stopped else None)
