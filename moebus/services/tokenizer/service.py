"""TokenizerService: queue-grouped `render` and `detokenize` endpoints over NATS."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from moebus.devmodel.toy import TOY_MODEL, ToyTokenizer
from moebus.shared.deepseek_v4 import recipe_version
from moebus.shared.errors import ErrorCode, ServiceError, context_length_exceeded
from moebus.shared.messages import DetokenizeReply, DetokenizeRequest, RenderReply, RenderRequest
from moebus.shared.service import Service
from moebus.shared.stop_strings import apply_stops, matched_stop
from moebus.shared.subjects import Queues
from moebus.shared.tracing import Attr, annotate

from .config import TokenizerConfig
from .detok import decode_step
from .images import encode_with_images, flatten, new_marker
from .recipe import Recipe, RecipeError, v4_tokenizer_json

_INLINE_CHARS = 8192  # longer prompts are encoded off the event loop


def load_tokenizer(model: str, chat_template_file: str | None = None) -> Any:
    template = Path(chat_template_file).read_text() if chat_template_file else None
    if model == TOY_MODEL:
        return ToyTokenizer(chat_template=template)
    from moebus.engine.tokenizer import load_tokenizer as engine_load  # torch-side import, only here

    return engine_load(model, template)


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(self, cfg: TokenizerConfig, tokenizer: Any = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.cfg: TokenizerConfig = cfg
        self.served_model = cfg.served_model_name or cfg.model
        self.tok = tokenizer
        self._skip: frozenset[int] = frozenset()
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
        if req.prompt_token_ids is not None:
            return self._check_ids(req.prompt_token_ids, req.max_prompt_tokens)
        marker, offsets = new_marker(), []
        if req.messages is not None and self.recipe is not None:
            text, ids = await self._render_recipe(req)
        elif req.messages is not None:
            messages, n_images = flatten(req.messages, marker)
            if n_images != len(req.images) or (n_images and req.image_form is None):
                raise ServiceError(ErrorCode.BAD_REQUEST, f"{n_images} image parts but {len(req.images)} "
                                   "encoded images", param="messages")
            text = self._apply_template(req, messages)
        else:
            text = req.prompt or ""
        if req.messages is not None and self.recipe is not None:
            pass  # encoded by the recipe
        elif req.images:
            ids, offsets = encode_with_images(self.tok, text, marker, req.images, req.image_form)
            text = text.replace(marker, "<image>")
        elif len(text) > _INLINE_CHARS:
            ids = await asyncio.to_thread(self.tok.encode, text)
        else:
            ids = self.tok.encode(text)
        if req.max_prompt_tokens is not None and len(ids) >= req.max_prompt_tokens:
            param = "messages" if req.messages is not None else "prompt"
            raise context_length_exceeded(req.max_prompt_tokens, len(ids), param)
        self._renders.inc()
        self._prompt_tokens.inc(len(ids))
        annotate({Attr.MODEL: req.model, Attr.INPUT_TOKENS: len(ids), "moebus.images": len(req.images),
                  "moebus.chat": req.messages is not None})
        return RenderReply(prompt_token_ids=ids, prompt_text=text, eos_token_ids=list(self.tok.eos_token_ids),
                           image_offsets=offsets)

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
        ids = await asyncio.to_thread(self.recipe.encode, conv) if len(text) > _INLINE_CHARS else self.recipe.encode(conv)
        return text, ids

    def _apply_template(self, req: RenderRequest, messages: list[dict]) -> str:
        """The chat template's text. continue_final_message: rendered without the generation prompt
        and cut right after the last message's content (its end-of-turn tokens left off)."""
        kwargs = dict(req.chat_template_kwargs)  # only when given: a tokenizer may take no extra arguments
        if req.tools is not None:
            kwargs["tools"] = req.tools
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt
                                                and not req.continue_final_message, **kwargs)
        except Exception as e:  # template errors (e.g. bad role order) are the client's
            raise ServiceError(ErrorCode.BAD_REQUEST, f"chat template: {e}", param="messages") from e
        if req.continue_final_message:
            last = messages[-1].get("content") if messages else None
            at = text.rfind(last) if isinstance(last, str) and last else -1
            if at < 0:
                raise ServiceError(ErrorCode.BAD_REQUEST, "continue_final_message: the last message has no text "
                                   "content the template kept", param="messages")
            text = text[:at + len(last)]
        return text

    def _check_ids(self, ids: list[int], max_prompt_tokens: int | None) -> RenderReply:
        """A prompt given as token ids: every id must be in the vocabulary (the engine indexes with it)."""
        if max_prompt_tokens is not None and len(ids) >= max_prompt_tokens:
            raise context_length_exceeded(max_prompt_tokens, len(ids), "prompt")
        vocab = getattr(self.tok, "vocab_size", None) or 2**31
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ServiceError(ErrorCode.BAD_REQUEST, f"token id {bad} is outside the vocabulary (ids 0..{vocab - 1})",
                               param="prompt")
        return RenderReply(prompt_token_ids=ids, eos_token_ids=list(self.tok.eos_token_ids))

    async def detokenize(self, req: DetokenizeRequest, _: Msg) -> DetokenizeReply:
        self._check_model(req.model)
        delta, prefix, read = decode_step(self.tok, req.token_ids, req.read_offset, self._skip, req.finished)
        text, held, stopped = apply_stops(req.held, delta, req.stop, include_stop=req.include_stop,
                                          finished=req.finished)
        return DetokenizeReply(text=text, held=held, prefix_offset=prefix, read_offset=read, stopped=stopped,
                               stop_reason=matched_stop(req.held + delta, req.stop) if stopped else None)
