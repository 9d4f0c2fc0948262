"""Vision encoder service: images in, rows of the language model's input embeddings out.

Importing the package (config, cache) stays torch-free; the service imports the engine's vision
code (and torch) on first use. Other services reach it only over the bus (Subjects.encoder_encode).
"""
from typing import Any

from .cache import ByteLRU
from .config import EncoderConfig

__all__ = ["ByteLRU", "EncoderConfig", "EncoderService"]


def __getattr__(name: str) -> Any:
    if name == "EncoderService":
        from .service import EncoderService

        return EncoderService
    raise AttributeError(name)
