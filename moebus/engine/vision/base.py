"""The one interface every image encoder implements (the encoder service depends on nothing else)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image


@dataclass(frozen=True, slots=True)
class PromptForm:
    """How an image appears in the prompt: `prefix` text, `length` copies of the placeholder token,
    `suffix` text. The tokenizer expands each image part of a chat message to this."""

    placeholder_token_id: int
    prefix: str = ""
    suffix: str = ""


class ImageEncoder(Protocol):
    name: str  # names the weights and settings: folded into the image's content hash
    hidden_size: int  # the language model's embedding width

    def num_tokens(self, image: Image.Image) -> int:
        """Placeholder tokens this image takes in the prompt."""
        ...

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """A decoded RGB image -> the pixel tensor `encode` takes (resize, rescale, normalise)."""
        ...

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """One batch of preprocessed images -> per image [num_tokens, hidden_size] embeddings."""
        ...

    def prompt_form(self) -> PromptForm: ...
