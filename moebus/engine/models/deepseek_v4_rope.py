"""RoPE frequencies of DeepSeek-V4's two rope kinds: "main" (sliding layers, plain) and "compress"
(CSA/HCA layers and their compressors: base `compress_rope_theta`, YaRN-scaled in the released
checkpoints). Same float32 formulas as HF's default and YaRN rope init (truncated correction
range); V4 scales cos/sin by `attention_factor`, which its config pins to 1.0 for YaRN."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    yarn_factor: float | None = None  # None: plain rope
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    @classmethod
    def from_hf(cls, params: dict, theta: float) -> RopeSpec:
        """One rope-type dict of an HF V4 config (`rope_parameters["compress"]`, or its flat form)."""
        kind = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", theta)
        if kind == "default":
            return cls(theta)
        if kind != "yarn":
            raise NotImplementedError(f"rope_type {kind!r} for DeepSeek-V4 compressed layers")
        return cls(theta, float(params["factor"]), int(params["original_max_position_embeddings"]),
                   float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                   float(params.get("attention_factor", 1.0)))

    def inv_freq(self, dim: int, device: torch.device | None = None) -> torch.Tensor:
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        if self.yarn_factor is None:
            return 1.0 / pos_freqs
        base, orig = self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        return (1.0 / (self.yarn_factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate

    def cos_sin(self, positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, dim/2] (the rotary kernels' layout) at integer positions [T]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(dim, positions.device)[None, :]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)
