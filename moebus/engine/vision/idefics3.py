"""Idefics3 / SmolVLM image encoder: SigLIP tower, pixel-shuffle connector, projection to the LM width.

One image = one global view, resized to vision_config.image_size squared: HF's processor with
`do_image_splitting=False`. Image splitting (the row x col crops SmolVLM checkpoints enable by
default, each with its own `<row_i_col_j>` tag) is not supported, so an image always takes
image_seq_len = (patches_per_side / scale_factor)**2 placeholder tokens and the prompt form
`<fake_token_around_image><global-img>` + `<image>` * image_seq_len + `<fake_token_around_image>`,
as HF's Idefics3Processor writes a non-split image.

Loading (checkpoint folder or llama.cpp mmproj GGUF) lives in engine/vision/idefics3_load.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import nn

from moebus.engine.vision.base import PromptForm
from moebus.engine.vision.siglip import SiglipArgs, SiglipVisionTransformer

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TAG = "<global-img>"


@dataclass(slots=True)
class Idefics3Args:
    """The vision side of an HF Idefics3Config: vision_config, scale_factor, text width, image token."""

    vision: SiglipArgs
    text_hidden_size: int
    image_token_id: int
    scale_factor: int = 2

    def __post_init__(self) -> None:
        if self.vision.patches_per_side % self.scale_factor:
            raise ValueError(f"patches per side ({self.vision.patches_per_side}) must be a multiple of "
                             f"scale_factor ({self.scale_factor})")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Idefics3Args:
        return cls(SiglipArgs.from_hf_config(cfg["vision_config"]), int(cfg["text_config"]["hidden_size"]),
                   int(cfg["image_token_id"]), int(cfg.get("scale_factor", 2)))

    @property
    def image_seq_len(self) -> int:
        return (self.vision.patches_per_side // self.scale_factor) ** 2


@dataclass(frozen=True, slots=True)
class ImagePreprocess:
    """HF Idefics3ImageProcessor without splitting: longest edge to `longest_edge` (aspect kept, the
    short side rounded up to even), then a square `image_size` resize, rescale, normalise."""

    image_size: int
    longest_edge: int | None = None  # None: resize straight to the square
    resample: int = Image.Resampling.LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, pre: dict, image_size: int) -> ImagePreprocess:
        """From a preprocessor_config.json (its keys; absent ones keep HF's defaults)."""
        square = (pre.get("max_image_size") or {}).get("longest_edge", image_size)
        if square != image_size:
            raise ValueError(f"max_image_size {square} != the vision tower's image_size {image_size}")
        d = cls(image_size)
        return cls(image_size, (pre.get("size") or {}).get("longest_edge"), int(pre.get("resample", d.resample)),
                   float(pre.get("rescale_factor", d.rescale_factor)) if pre.get("do_rescale", True) else 1.0,
                   *_mean_std(pre, d))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """A PIL image -> float32 [3, image_size, image_size]."""
        image = image.convert("RGB")
        if self.longest_edge is not None:
            image = image.resize(_fit_longest_edge(image.height, image.width, self.longest_edge)[::-1],
                                 self.resample)
        image = image.resize((self.image_size, self.image_size), self.resample)
        x = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def _mean_std(pre: dict, d: ImagePreprocess) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if not pre.get("do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return _per_channel(pre.get("image_mean", d.image_mean)), _per_channel(pre.get("image_std", d.image_std))


def _per_channel(v: object) -> tuple[float, ...]:
    return tuple(float(x) for x in v) if isinstance(v, list | tuple) else (float(v),) * 3


def _fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    # HF's _resize_output_size_rescale_to_max_len: the short side is truncated, then made even.
    if width >= height:
        h = int(longest / (width / height))
        return max(h + h % 2, 1), longest
    w = int(longest * (width / height))
    return longest, max(w + w % 2, 1)


class Idefics3Connector(nn.Module):
    def __init__(self, a: Idefics3Args) -> None:
        super().__init__()
        self.scale_factor = a.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(a.vision.hidden_size * a.scale_factor**2, a.text_hidden_size,
                                                  bias=False)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[B, side*side, D] -> [B, (side/s)**2, s*s*D]: each s x s block of patches becomes one row,
        features ordered (row in block, column in block, channel), as HF's Idefics3Connector does."""
        b, n, d = x.shape
        s, side = self.scale_factor, int(round(n**0.5))
        x = x.view(b, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (side // s) ** 2, s * s * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Idefics3VisionModel(nn.Module):
    """pixels [B, 3, S, S] -> [B, image_seq_len, text_hidden_size]; keys as HF's `model.*` minus `model.`."""

    def __init__(self, args: Idefics3Args) -> None:
        super().__init__()
        self.args = args
        self.vision_model = SiglipVisionTransformer(args.vision)
        self.connector = Idefics3Connector(args)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.connector(self.vision_model(pixels))

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        if set(state) != set(own):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise KeyError(f"idefics3 vision weights: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, t in state.items():
            if t.shape != own[name].shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(own[name].shape)}")
        self.load_state_dict(state)


class Idefics3Encoder:
    """engine.vision.base.ImageEncoder for Idefics3 / SmolVLM (single global image, no splitting)."""

    def __init__(self, model: Idefics3VisionModel, preprocess: ImagePreprocess, name: str) -> None:
        self.model = model.eval()
        self._preprocess = preprocess
        self.name = name
        self.hidden_size = model.args.text_hidden_size

    def num_tokens(self, image: Image.Image) -> int:
        return self.model.args.image_seq_len  # every image is one global view

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        return self._preprocess(image)

    @torch.no_grad()
    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        if not pixels:
            return []
        w = self.model.connector.modality_projection.proj.weight
        return list(self.model(torch.stack(pixels).to(w.device, w.dtype)).unbind(0))

    def prompt_form(self) -> PromptForm:
        return PromptForm(self.model.args.image_token_id, FAKE_IMAGE_TOKEN + GLOBAL_IMAGE_TAG, FAKE_IMAGE_TOKEN)
