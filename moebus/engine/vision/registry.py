"""Picks and builds the image encoder for a language model (the encoder service's one entry point)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from moebus.engine.models import resolve
from moebus.engine.vision.base import ImageEncoder

DEFAULT_ENCODER = "efficientnet-lite0"  # the embedded default: ImageNet class names (vision/classname.py)


def input_embeddings(model: str) -> torch.Tensor:
    """The language model's token-embedding table [vocab, hidden], read alone from its checkpoint."""
    from moebus.engine.loader.gguf_cache import converted_dir

    path = resolve(model)
    if path.suffix == ".gguf":
        path = converted_dir(path)
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in ("model.embed_tokens.weight", "model.text_model.embed_tokens.weight"):
                if name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    return st.get_tensor(name).float()
    raise FileNotFoundError(f"{model}: no token-embedding table in its safetensors")


def load_encoder(encoder: str, model: str, top_k: int = 3) -> ImageEncoder:
    """`efficientnet-lite0` (for any language model: it speaks through the model's own embeddings),
    or a SmolVLM / Idefics3 checkpoint folder or mmproj .gguf (its projector must match `model`)."""
    if encoder == DEFAULT_ENCODER:
        from moebus.engine.vision.classname import ClassNameEncoder
        from moebus.text.tokenizer import load_tokenizer

        tok = load_tokenizer(model)
        return ClassNameEncoder(input_embeddings(model), lambda s: tok.encode(s, add_special_tokens=False),
                                placeholder_token_id=0, top_k=top_k)
    path = Path(encoder)
    if path.is_dir() or path.suffix == ".gguf":
        from moebus.engine.vision import idefics3_load
        from moebus.text.tokenizer import load_tokenizer

        # An mmproj GGUF holds no vocabulary: the <image> token id comes from the language model's.
        image_token_id = load_tokenizer(model).backend.token_to_id("<image>") if path.suffix == ".gguf" else None
        return idefics3_load.load_encoder(path, image_token_id=image_token_id)
    raise ValueError(f"unknown image encoder {encoder!r}: use {DEFAULT_ENCODER!r}, a SmolVLM/Idefics3 "
                     "checkpoint folder or an mmproj .gguf")
