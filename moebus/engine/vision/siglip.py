"""SigLIP vision transformer as Idefics3 / SmolVLM use it: square images in, one row per patch out.

Patch-embedding conv + learned position embeddings, pre-norm encoder layers (bidirectional
attention, tanh-GELU MLP), a final LayerNorm. Module names follow HF's `Idefics3VisionTransformer`
so checkpoint keys load unchanged. Only full-size images: HF's NaViT-style variable resolution
(patch masks, bucketed position ids) reduces to position id = patch index when every patch is real.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(slots=True)
class SiglipArgs:
    """Maps 1:1 to HF's Idefics3VisionConfig (a checkpoint's `vision_config`)."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> SiglipArgs:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in cfg.items() if k in names})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(a.num_channels, a.hidden_size, a.patch_size, stride=a.patch_size)
        self.position_embedding = nn.Embedding(a.patches_per_side**2, a.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, patches, hidden], row-major
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.nh, self.hd = a.num_attention_heads, a.hidden_size // a.num_attention_heads
        self.q_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.k_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.v_proj = nn.Linear(a.hidden_size, a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.nh, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)
        self.act = _ACTIVATIONS[a.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.self_attn = SiglipAttention(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = SiglipMLP(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, a: SiglipArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(a) for _ in range(a.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, args: SiglipArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = SiglipEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, C, image_size, image_size] -> [B, patches_per_side**2, hidden_size]."""
        a = self.args
        if pixels.shape[1:] != (a.num_channels, a.image_size, a.image_size):
            raise ValueError(f"expected pixels [B, {a.num_channels}, {a.image_size}, {a.image_size}], "
                             f"got {tuple(pixels.shape)}")
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
