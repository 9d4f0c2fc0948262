"""Llama-architecture decoder (SmolLM2 and friends) on the paged attention backend."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, KVCacheSpec, attend
from moebus.engine.lm_head import float_logits
from moebus.engine.models.weights import quantize_head, quantize_linear
from moebus.engine.multimodal import MMEmbeds
from moebus.kernels import fused_add_rms_norm, rms_norm, rotary_cos_sin, silu_and_mul
from moebus.kernels.rotary import apply_rotary_
from moebus.platforms.interface import DecodeStep


@dataclass(slots=True)
class LlamaArgs:
    """Maps 1:1 to the HF LlamaConfig fields we use."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in cfg.items() if k in names}
        kw.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        kw.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        return cls(**kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=False)
        self.scale = self.hd**-0.5

    def forward(self, x, cos, sin, meta, kv_cache):
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        # In place on the projection's q/k views: no new q/k tensors (attend takes strided q and k).
        q, k = apply_rotary_(q.view(-1, self.nh, self.hd), k.view(-1, self.nkv, self.hd), cos, sin)
        o = attend(q, k, v.view(-1, self.nkv, self.hd), kv_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    # Long prefill chunks run the MLP this many rows at a time: the [rows, 2I] intermediate then
    # stays in cache instead of a fresh 50 MB buffer per layer (SmolLM2, 4096 rows). Not below
    # the default step budget (2048): split 1024 + 512, a bf16 step pays a 512-row GEMM (slow per
    # row) and a copy to join the halves (docs/benchmarks/history-peers.md, "Prefill step: the MLP
    # unchunked up to the step budget").
    chunk_rows: int = 2048

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        if x.shape[0] <= self.chunk_rows:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return torch.cat([self.down_proj(silu_and_mul(self.gate_up_proj(c))) for c in x.split(self.chunk_rows)])


class LlamaLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = LlamaMLP(a.hidden_size, a.intermediate_size)

    def forward(self, x, residual, cos, sin, meta, kv_cache):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    accepts_image_embeds = True  # forward(mm_embeds=...) overwrites placeholder rows
    decode_stack = "llama"  # which batch-1 decode step a platform may give it (decode_fast_path)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # One sequence, one new token: the platform's batch-1 step, set at load (on CPU the whole stack
        # in one C call: platforms/cpu/decode_fast_path.py says when); None: the module path.
        self.decode_fast_path: DecodeStep | None = None

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        a = self.args
        return [KVCacheSpec(a.num_key_value_heads, a.head_dim, a.head_dim) for _ in range(a.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                mm_embeds: MMEmbeds | None = None) -> torch.Tensor:
        if self.decode_fast_path is not None and mm_embeds is None:
            hidden = self.decode_fast_path(self, input_ids, positions, meta, kv_caches)
            if hidden is not None:
                return hidden
        cos, sin = rotary_cos_sin(positions, self.args.head_dim, self.args.rope_theta, torch.float32)
        x, residual = self.embed_tokens(input_ids), None
        if mm_embeds is not None:  # image rows replace their placeholder tokens' embeddings
            x = mm_embeds.apply(x)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, never rounded to the weights' dtype (engine/lm_head.py)."""
        return float_logits(self.lm_head, self.embed_tokens, hidden)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor],
                     quantized: dict[str, tuple[str, torch.Tensor]] | None = None,
                     activation_bits: int | None = 16) -> None:
        """Load HF-named weights; q/k/v and gate/up are fused here to cut kernel launches.
        `quantized` (HF name -> (GGUF type, blocks)): linear layers whose parts are all there in one
        type become QuantLinear on those blocks (their dense copies in state_dict are dropped), and
        a tied LM head runs on the embedding's blocks (the dense embedding stays for lookups);
        activation_bits: theirs (QuantLinear)."""
        sd = dict(state_dict)
        if quantized:
            self._quantize_linears(sd, quantized, activation_bits)
        own = dict(self.named_parameters())
        for i in range(self.args.num_hidden_layers):
            p = f"model.layers.{i}."
            if p + "self_attn.q_proj.weight" in sd:  # else quantized
                qkv = [sd.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
                sd[p + "self_attn.qkv_proj.weight"] = torch.cat(qkv)
            if p + "mlp.gate_proj.weight" in sd:
                gu = [sd.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
                sd[p + "mlp.gate_up_proj.weight"] = torch.cat(gu)
        if self.args.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        loaded = set()
        for name, tensor in sd.items():
            key = name.removeprefix("model.")
            if key not in own:
                raise KeyError(f"unexpected weight {name}")
            if own[key].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(own[key].shape)}")
            own[key].copy_(tensor)
            loaded.add(key)
        missing = set(own) - loaded
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:5]}")

    def _quantize_linears(self, sd: dict[str, torch.Tensor], quantized: dict[str, tuple[str, torch.Tensor]],
                          activation_bits: int | None) -> None:
        def swap(parent: nn.Module, attr: str, names: list[str]) -> None:
            quantize_linear(parent, attr, names, quantized, sd, activation_bits)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            swap(layer.self_attn, "qkv_proj", [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            swap(layer.self_attn, "o_proj", [p + "self_attn.o_proj.weight"])
            swap(layer.mlp, "gate_up_proj", [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")])
            swap(layer.mlp, "down_proj", [p + "mlp.down_proj.weight"])
        quantize_head(self, quantized, sd, activation_bits)
