"""RenderRequest -> RenderReply with a tokenizer in this process: the chat template (with the
request's tools), images placed where the template put their markers, the context check.

One home for the rendering that the tokenizer service does for every frontend and that a frontend
with a local copy of the tokenizer does itself (no bus round trip before routing: issue 21 target
3). The tokenizer is any object with `encode`, `apply_chat_template`, `eos_token_ids` (moebus.text's
Tokenizer, the toy's); no torch here. DeepSeek-V4's recipe rendering stays in the tokenizer service.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from moebus.shared.errors import ErrorCode, ServiceError, context_length_exceeded
from moebus.shared.messages import ChatMessage, ImagePromptForm, RenderReply, RenderRequest

INLINE_CHARS = 8192  # longer prompts are encoded off the event loop


class PromptRenderer:
    def __init__(self, tok: Any) -> None:
        self.tok = tok

    async def render(self, req: RenderRequest) -> RenderReply:
        """Raises ServiceError (BAD_REQUEST, PROMPT_TOO_LONG) for what the client must fix."""
        if req.prompt_token_ids is not None:
            return self.check_ids(req.prompt_token_ids, req.max_prompt_tokens)
        marker, offsets = new_marker(), []
        if req.messages is not None:
            messages, n_images = flatten(req.messages, marker)
            if n_images != len(req.images) or (n_images and req.image_form is None):
                raise ServiceError(ErrorCode.BAD_REQUEST, f"{n_images} image parts but {len(req.images)} "
                                   "encoded images", param="messages")
            text = apply_template(self.tok, req, messages)
        else:
            text = req.prompt or ""
        if req.images:
            ids, offsets = encode_with_images(self.tok, text, marker, req.images, req.image_form)
            text = text.replace(marker, "<image>")
        elif len(text) > INLINE_CHARS:
            ids = await asyncio.to_thread(self.tok.encode, text)
        else:
            ids = self.tok.encode(text)
        check_length(req, len(ids))
        return RenderReply(prompt_token_ids=ids, prompt_text=text, eos_token_ids=list(self.tok.eos_token_ids),
                           image_offsets=offsets)

    def check_ids(self, ids: list[int], max_prompt_tokens: int | None) -> RenderReply:
        """A prompt given as token ids: every id must be in the vocabulary (the engine indexes with it)."""
        if max_prompt_tokens is not None and len(ids) >= max_prompt_tokens:
            raise context_length_exceeded(max_prompt_tokens, len(ids), "prompt")
        vocab = getattr(self.tok, "vocab_size", None) or 2**31
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ServiceError(ErrorCode.BAD_REQUEST, f"token id {bad} is outside the vocabulary (ids 0..{vocab - 1})",
                               param="prompt")
        return RenderReply(prompt_token_ids=ids, eos_token_ids=list(self.tok.eos_token_ids))


def check_length(req: RenderRequest, n_tokens: int) -> None:
    if req.max_prompt_tokens is not None and n_tokens >= req.max_prompt_tokens:
        param = "messages" if req.messages is not None else "prompt"
        raise context_length_exceeded(req.max_prompt_tokens, n_tokens, param)


def apply_template(tok: Any, req: RenderRequest, messages: list[dict]) -> str:
    """The chat template's text. continue_final_message: rendered without the generation prompt
    and cut right after the last message's content (its end-of-turn tokens left off)."""
    kwargs = dict(req.chat_template_kwargs)  # only when given: a tokenizer may take no extra arguments
    if req.tools is not None:
        kwargs["tools"] = req.tools
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt
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


# Chat prompts with images: the template renders a per-request marker where each image goes; the
# text between markers is encoded piece by piece, with the image's placeholder tokens in between.

def flatten(messages: list[ChatMessage], marker: str) -> tuple[list[dict], int]:
    """Messages for the chat template (content as one string, images as `marker`), and how many
    image parts there were."""
    out, images = [], 0
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(marker if p.type == "image" else (p.text or "") for p in m.content)
            images += sum(p.type == "image" for p in m.content)
        out.append(d)
    return out, images


def new_marker() -> str:
    # Random per request, so text a client writes can never be taken for an image position.
    return f"<|moebus-image-{uuid.uuid4().hex}|>"


def encode_with_images(tok: Any, text: str, marker: str, counts: list[int],
                       form: ImagePromptForm) -> tuple[list[int], list[int]]:
    """(token ids, offset of each image's first placeholder)."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(counts):
        raise ServiceError(ErrorCode.BAD_REQUEST, f"the chat template placed {len(pieces) - 1} of "
                           f"{len(counts)} images", param="messages")
    ids = tok.encode(pieces[0])
    offsets = []
    for n, piece in zip(counts, pieces[1:], strict=True):
        ids += tok.encode(form.prefix, add_special_tokens=False) if form.prefix else []
        offsets.append(len(ids))
        ids += [form.placeholder_token_id] * n
        ids += tok.encode(form.suffix + piece, add_special_tokens=False) if form.suffix + piece else []
    return ids, offsets
