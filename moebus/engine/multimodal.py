"""Image embeddings inside a request: where they sit in the prompt and how a step applies them.

An image occupies `length` placeholder tokens of the prompt starting at `offset`; the encoder's rows
replace those tokens' embeddings when the positions are computed (prefill, or recompute after
preemption). Prefix caching tells images apart by content hash (kv.hashing.mm_hash_view).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moebus.kv.hashing import mm_hash_view


@dataclass(frozen=True, slots=True)
class ImageSpan:
    offset: int  # prompt position of the first placeholder
    embeds: torch.Tensor  # [length, hidden]: one row per placeholder token
    content_hash: int  # 63-bit hash of the image bytes (and encoder), names the image everywhere

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.length


def check_spans(spans: list[ImageSpan], num_prompt_tokens: int, hidden_size: int) -> None:
    """Spans must lie inside the prompt, in order, without overlap, with the model's width."""
    end = 0
    for s in spans:
        if s.embeds.dim() != 2 or s.embeds.shape[1] != hidden_size:
            raise ValueError(f"image embeddings must be [n, {hidden_size}], got {tuple(s.embeds.shape)}")
        if s.offset < end or s.end > num_prompt_tokens or s.length == 0:
            raise ValueError(f"image span [{s.offset}, {s.end}) is outside the prompt or overlaps another")
        end = s.end


def hash_view(token_ids: list[int], spans: list[ImageSpan]) -> list[int]:
    """Token ids for block hashing: placeholders carry their image's hash, so equal hashes mean equal
    images as well as equal text."""
    return mm_hash_view(token_ids, [(s.offset, s.length, s.content_hash) for s in spans])


@dataclass(frozen=True, slots=True)
class MMEmbeds:
    """Rows of one step's flattened batch whose embeddings come from images."""

    rows: torch.Tensor  # [m] int64 flat token index
    values: torch.Tensor  # [m, hidden]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, self.rows, self.values.to(x.dtype))


def step_embeds(chunks: list[tuple[int, int, int, list[ImageSpan]]], device: torch.device) -> MMEmbeds | None:
    """chunks: (flat index of the chunk's first token, its first position, token count, the request's
    spans). Returns the rows the chunk's positions take from images, or None when there are none."""
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for flat, start, n, spans in chunks:
        for s in spans:
            lo, hi = max(start, s.offset), min(start + n, s.end)
            if lo < hi:
                rows.append(torch.arange(flat + lo - start, flat + hi - start))
                values.append(s.embeds[lo - s.offset: hi - s.offset])
    if not rows:
        return None
    return MMEmbeds(torch.cat(rows).to(device), torch.cat(values).to(device))
