"""Prompts rendered in the frontend's own process (FrontendConfig.local_render): the tokenizer
service's renderer (moebus/text/prompt_render.py) on a copy of its tokenizer, which saves a request the
bus round trip to the tokenizer before it is routed (issue 21 target 3). Anything this copy cannot
do the same way goes to the tokenizer service: another model's prompts, and DeepSeek-V4's, which
its recipe renders there."""
from __future__ import annotations

import asyncio
import logging

from moebus.shared.deepseek_v4 import recipe_version
from moebus.shared.messages import RenderReply, RenderRequest
from moebus.shared.tracing import Attr, Tracing
from moebus.text.prompt_render import PromptRenderer

from ..config import LocalRender

log = logging.getLogger(__name__)


class LocalRenderer:
    def __init__(self, model: str, renderer: PromptRenderer, tracing: Tracing) -> None:
        self.model, self.renderer, self.tracing = model, renderer, tracing

    @classmethod
    async def load(cls, cfg: LocalRender, tracing: Tracing) -> LocalRenderer | None:
        """None when the tokenizer service must render (a recipe model, or the tokenizer would not load)."""
        if recipe_version(cfg.model) is not None:
            return None
        from moebus.text.serving_tokenizer import load_serving_tokenizer  # tokenizers: only here

        try:
            tok = await asyncio.to_thread(load_serving_tokenizer, cfg.model, cfg.chat_template)
        except Exception:
            log.warning("could not load the tokenizer of %s: prompts render in the tokenizer service", cfg.model,
                        exc_info=True)
            return None
        return cls(cfg.served_model_name or cfg.model, PromptRenderer(tok), tracing)

    def serves(self, req: RenderRequest) -> bool:
        return req.model == self.model

    async def render(self, req: RenderRequest) -> RenderReply:
        """As the tokenizer service's `render` (its span too); raises its ServiceErrors."""
        with self.tracing.span("render") as span:
            reply = await self.renderer.render(req)
            if span.is_recording() and req.prompt_token_ids is None:
                span.set_attributes({Attr.MODEL: req.model, Attr.INPUT_TOKENS: len(reply.prompt_token_ids),
                                     "moebus.images": len(req.images), "moebus.chat": req.messages is not None,
                                     "moebus.render.local": True})
            return reply
