"""DeepSeek-V4 multi-token-prediction (nextn) layer, built from the checkpoint's `mtp.{i}.*` tensors.

As DeepSeek's own inference code (`MTPBlock`): the main model's mHC streams at position j (before
`hc_head`) and the embedding of token j+1 are mixed,
    x = e_proj(enorm(embed(x_{j+1}))) + h_proj(hnorm(streams_j))      (e broadcast over the streams)
then run through one ordinary V4 block (sliding attention, learned-routing MoE), and collapsed by
the layer's own `hc_head` and `norm`; the shared `lm_head` turns that into logits for x_{j+2}.
`embed_tokens` and `lm_head` are the main model's (the release has no MTP copies).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn

from moebus.engine.models.deepseek_v4 import (
    DeepseekV4Args,
    DeepseekV4DecoderLayer,
    DeepseekV4ForCausalLM,
    V4Step,
)
from moebus.engine.models.deepseek_v4_attention import RMSNorm
from moebus.engine.models.hf_checkpoint import MTP_OWN
from moebus.engine.models.hyper_connections import HyperHead

_MTP_NAME = re.compile(r"^(?:.*\.)?mtp\.(\d+)\.(.+)$")


def mtp_args(args: DeepseekV4Args) -> DeepseekV4Args:
    """The nextn block's hyper-parameters: the main model's, one sliding / `moe` layer."""
    return replace(args, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])


class DeepseekV4MTPLayer(nn.Module):
    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        a, eps = mtp_args(args), args.rms_norm_eps
        self.config = a
        self.e_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=False)
        self.h_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=False)
        self.enorm, self.hnorm, self.norm = (RMSNorm(a.hidden_size, eps) for _ in range(3))
        self.hc_head = HyperHead(a.hidden_size, a.hc_mult, a.hc_eps, eps)
        self.layers = nn.ModuleList([DeepseekV4DecoderLayer(a, 0)])  # `layers.0`: the main model's layout
        self.lm_head = None  # shared: see module docstring

    # Same HF <-> ours naming, expert stacking and rotary re-layout as the main model's layers.
    _hf_layout = DeepseekV4ForCausalLM._hf_layout
    load_weights = DeepseekV4ForCausalLM.load_weights

    def forward(self, streams: torch.Tensor, embeds: torch.Tensor, next_ids: torch.Tensor, step: V4Step,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """streams [T, hc, H] (the target's, or this layer's own output when chaining), embeds [T, H]
        of next_ids [T]; returns this layer's output streams [T, hc, H]."""
        x = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return self.layers[0](x, next_ids, step, kv_cache)

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(streams))


def checkpoint_names(mtp_weights: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Release names `mtp.{i}.<rest>` -> per layer i, names `load_weights` reads: the block's as
    on-disk `layers.0.<rest>`, the MTP-only ones as the top-level tensors they mirror."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in mtp_weights.items():
        m = _MTP_NAME.match(key)
        if m is None:
            raise KeyError(f"unrecognised MTP tensor {key}")
        i, rest = int(m[1]), m[2]
        if rest in MTP_OWN:
            rest = {"e_proj.weight": "model.e_proj.weight", "h_proj.weight": "model.h_proj.weight",
                    "enorm.weight": "model.enorm.weight", "hnorm.weight": "model.hnorm.weight"}.get(rest, rest)
            # norm.weight / hc_head_* are spelled as the main model's top-level ones
        else:
            rest = f"layers.0.{rest}"
        by_layer.setdefault(i, {})[rest] = t
    return by_layer


def load_mtp_layers(model: DeepseekV4ForCausalLM, hf_config: dict | None = None) -> list[DeepseekV4MTPLayer]:
    """The checkpoint's nextn layers (config `num_nextn_predict_layers` of them), on the model's
    device and dtype. Raises if the checkpoint lacks them, or if config.json's legacy
    `compress_ratios` gives one a compressed attention kind (the release's is 0: sliding)."""
    n = model.config.num_nextn_predict_layers
    extra = list((hf_config or {}).get("compress_ratios") or [])[model.config.num_hidden_layers:]
    if any(extra):
        raise NotImplementedError(f"nextn layers with compressed attention (compress_ratios {extra})")
    by_layer = checkpoint_names(model.mtp_weights)
    if n < 1 or sorted(by_layer) != list(range(n)):
        raise ValueError(f"checkpoint has MTP layers {sorted(by_layer)}; config says "
                         f"num_nextn_predict_layers={n}")
    p = next(model.parameters())
    layers = []
    for i in range(n):
        layer = DeepseekV4MTPLayer(model.config).to(device=p.device, dtype=p.dtype)
        layer.load_weights(by_layer[i])
        layers.append(layer.eval())
    return layers
