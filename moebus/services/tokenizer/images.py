"""Chat prompts with images: the template renders a per-request marker where each image goes; the
text between markers is encoded piece by piece, with the image's placeholder tokens in between."""
from __future__ import annotations

import uuid
from typing import Any

from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import ChatMessage, ImagePromptForm


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
