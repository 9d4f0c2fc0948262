"""Llama-attention decoders with MoE MLPs: Qwen3-MoE, Mixtral, OLMoE and GraniteMoE.

The four share one layer shape (GQA attention with neox RoPE, RMSNorm pre-norm, a softmax top-k
router over SwiGLU experts) and differ in a few knobs that `MoEDecoderArgs` names: where q/k are
normalised (Qwen3 per head, OLMoE over the whole projection), QKV clipping (OLMoE), which layers
are dense (Qwen3's `mlp_only_layers` / `decoder_sparse_step`), and Granite's four multipliers.
Granite's residual multiplier and logit scaling are folded into weights at load (o_proj, the
expert and dense down projections, the final norm): both are linear, so the layer computes the
same function with no extra op. Mixtral and Granite pick the top-k logits then softmax over
them; that equals softmax, top-k, renormalise (norm_topk_prob), which is how the router runs.

Checkpoint names (as HF's save_pretrained writes them) per family, mapped in `load_weights`:
experts per expert (`mlp.experts.{e}.{gate,up,down}_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w{1,3,2}`) or Granite's stacked `input_linear` / `output_linear`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, KVCacheSpec, attend
from moebus.engine.lm_head import float_logits
from moebus.engine.models.llama import LlamaMLP, RMSNorm
from moebus.engine.models.moe import MoE
from moebus.engine.models.quant_experts import QuantExperts
from moebus.engine.models.weights import assign, fuse, quantize_head, quantize_linear, stack_experts, take
from moebus.engine.quant_linear import QuantLinear
from moebus.kernels import rms_norm, rotary_cos_sin
from moebus.kernels.rotary import apply_rotary_
from moebus.platforms.interface import DecodeStep

QK_NORMS = ("none", "head", "full")


@dataclass(frozen=True, slots=True)
class MoEDecoderArgs:
    family: str  # the HF architecture name
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    dense_intermediate_size: int = 0  # dense layers' MLP width (0: every layer is MoE)
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense; empty: all MoE
    qk_norm: str = "none"
    clip_qkv: float | None = None
    attention_bias: bool = False
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None  # softmax scale; None: head_dim ** -0.5
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, not {self.qk_norm!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}")
        if self.moe_layers and len(self.moe_layers) != self.num_hidden_layers:
            raise ValueError("moe_layers needs one entry per layer")

    def is_moe(self, layer: int) -> bool:
        return not self.moe_layers or self.moe_layers[layer]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MoEDecoderArgs:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in _FAMILY_FIELDS:
            raise ValueError(f"unsupported architecture {arch!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        common = dict(
            family=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            num_experts_per_tok=cfg["num_experts_per_tok"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(arch, cfg), max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
        return cls(**common, **_FAMILY_FIELDS[arch](cfg))


def _num_experts(cfg: dict) -> int:
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not n:
        raise ValueError("config needs num_experts (or num_local_experts) > 0")
    return int(n)


def _qwen3_moe(cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    only_mlp, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1))
    return dict(moe_intermediate_size=cfg["moe_intermediate_size"], num_experts=_num_experts(cfg),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), qk_norm="head",
                dense_intermediate_size=cfg.get("intermediate_size", 0),
                moe_layers=tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(n)),
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None)


def _mixtral(cfg: dict) -> dict:
    return dict(moe_intermediate_size=cfg["intermediate_size"], num_experts=_num_experts(cfg), norm_topk_prob=True,
                sliding_window=cfg.get("sliding_window"))


def _olmoe(cfg: dict) -> dict:
    return dict(moe_intermediate_size=cfg["intermediate_size"], num_experts=_num_experts(cfg),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm="full", clip_qkv=cfg.get("clip_qkv"))


def _granite_moe(cfg: dict) -> dict:
    return dict(moe_intermediate_size=cfg["intermediate_size"], num_experts=_num_experts(cfg), norm_topk_prob=True,
                embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


_FAMILY_FIELDS = {"Qwen3MoeForCausalLM": _qwen3_moe, "MixtralForCausalLM": _mixtral,
                  "OlmoeForCausalLM": _olmoe, "GraniteMoeForCausalLM": _granite_moe}
ARCHITECTURES = tuple(_FAMILY_FIELDS)


def _rope_theta(arch: str, cfg: dict) -> float:
    """Plain RoPE only: transformers 5 nests the settings in `rope_parameters`, older configs keep
    `rope_theta` and `rope_scaling` at the top."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{arch}: rope_parameters.rope_type {kind!r} is not supported (only default)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class MoEDecoderAttention(nn.Module):
    def __init__(self, a: MoEDecoderArgs) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=a.attention_bias)
        self.qk_norm, self.eps, self.clip = a.qk_norm, a.rms_norm_eps, a.clip_qkv
        if a.qk_norm != "none":  # "head": one [hd] gain shared by the heads; "full": over every head's channels
            self.q_norm = nn.Parameter(torch.ones(self.hd if a.qk_norm == "head" else self.nh * self.hd))
            self.k_norm = nn.Parameter(torch.ones(self.hd if a.qk_norm == "head" else self.nkv * self.hd))
        self.scale = a.attention_multiplier if a.attention_multiplier is not None else self.hd ** -0.5
        self.sliding_window = a.sliding_window
        self.out_scale = 1.0  # Granite's residual multiplier where o_proj is quantized (else folded in)

    def forward(self, x, cos, sin, meta, kv_cache):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        elif self.qk_norm == "head":
            q = rms_norm(q.reshape(-1, self.hd), self.q_norm, self.eps)
            k = rms_norm(k.reshape(-1, self.hd), self.k_norm, self.eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = apply_rotary_(q.reshape(T, self.nh, self.hd), k.reshape(T, self.nkv, self.hd), cos, sin)
        o = attend(q, k, v.reshape(T, self.nkv, self.hd), kv_cache, meta, self.scale,
                   sliding_window=self.sliding_window)
        out = self.o_proj(o.flatten(1))
        return out if self.out_scale == 1.0 else out * self.out_scale


class MoEDecoderLayer(nn.Module):
    def __init__(self, a: MoEDecoderArgs, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MoEDecoderAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.is_moe = a.is_moe(index)
        if self.is_moe:
            self.mlp = MoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok,
                           num_shared_experts=0, scoring_func="softmax", norm_topk_prob=a.norm_topk_prob,
                           routed_scaling_factor=1.0, swiglu_limit=None, hash_vocab_size=None, score_bias=False)
        else:
            self.mlp = LlamaMLP(a.hidden_size, a.dense_intermediate_size)

    def forward(self, x, residual, input_ids, cos, sin, meta, kv_cache):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.mlp(x, input_ids) if self.is_moe else self.mlp(x)), residual


class MoEDecoderForCausalLM(nn.Module):
    decode_stack = "moe"  # which batch-1 decode step a platform may give it (decode_fast_path)

    def __init__(self, args: MoEDecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # One sequence, one new token: the platform's batch-1 step, set at load (on CPU the whole stack
        # in one C call: platforms/cpu/moe_decode.py says when); None: the module path.
        self.decode_fast_path: DecodeStep | None = None

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        a = self.args
        return [KVCacheSpec(a.num_key_value_heads, a.head_dim, a.head_dim, a.sliding_window)
                for _ in range(a.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.decode_fast_path is not None:
            hidden = self.decode_fast_path(self, input_ids, positions, meta, kv_caches)
            if hidden is not None:
                return hidden
        cos, sin = rotary_cos_sin(positions, self.args.head_dim, self.args.rope_theta, torch.float32)
        x, residual = self.embed_tokens(input_ids), None
        if self.args.embedding_multiplier != 1.0:
            x = x * self.args.embedding_multiplier
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, input_ids, cos, sin, meta, cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, never rounded to the weights' dtype (engine/lm_head.py)."""
        return float_logits(self.lm_head, self.embed_tokens, hidden)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor],
                     quantized: dict[str, tuple[str, torch.Tensor]] | None = None,
                     activation_bits: int | None = 16) -> None:
        """HF on-disk names (module docstring); fails naming the first unexpected, misshaped or
        missing tensor, before any layer serves. `quantized` (HF name -> (GGUF type, blocks), a
        GGUF's Q4_0/Q4_1/Q8_0 tensors, Q4_K ones as Q4_1, Q6_K/Q5_K as Q8_0): the routed experts run on those
        blocks (QuantExperts; gate|up in one type, down in its own), and so do the bias-free linear layers and the LM head
        (QuantLinear, with activation_bits)."""
        a, sd, q = self.args, dict(state_dict), quantized or {}
        if a.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            fuse(sd, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], p + "self_attn.qkv_proj.weight")
            if a.attention_bias:
                fuse(sd, [p + f"self_attn.{n}_proj.bias" for n in "qkv"], p + "self_attn.qkv_proj.bias")
            for n in ("q_norm", "k_norm"):
                if p + f"self_attn.{n}.weight" in sd:
                    sd[p + f"self_attn.{n}"] = sd.pop(p + f"self_attn.{n}.weight")
            if layer.is_moe:
                self._rename_moe(sd, p, q)
            else:
                fuse(sd, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up_proj.weight")
        assign(self, sd)
        if q:
            self._quantize_linears(q, activation_bits)
        m = a.residual_multiplier
        if m != 1.0:  # residual + f(x) * m == residual + (m * f)(x): f's last linear, or its output
            for layer in self.layers:
                attn = layer.self_attn
                if isinstance(attn.o_proj, QuantLinear):  # blocks are not rescaled: scale the output
                    attn.out_scale = m
                else:
                    attn.o_proj.weight.mul_(m)
                    if attn.o_proj.bias is not None:
                        attn.o_proj.bias.mul_(m)
                if not layer.is_moe:
                    layer.mlp.down_proj.weight.mul_(m)
                elif layer.mlp.quant_experts is not None:  # the combine weights carry it
                    layer.mlp.gate.routed_scaling_factor *= m
                else:
                    layer.mlp.w2.mul_(m)
        if a.logits_scaling != 1.0:  # logits / s == head(norm(x) / s): the final norm's gain
            self.norm.weight.div_(a.logits_scaling)

    def _quantize_linears(self, quantized: dict[str, tuple[str, torch.Tensor]], activation_bits: int | None) -> None:
        """The attention projections, dense MLPs and LM head on their GGUF blocks where whole."""
        sd: dict[str, torch.Tensor] = {}  # loaded already: nothing left to pop
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            quantize_linear(attn, "qkv_proj", [p + f"self_attn.{n}_proj.weight" for n in "qkv"], quantized, sd,
                            activation_bits)
            quantize_linear(attn, "o_proj", [p + "self_attn.o_proj.weight"], quantized, sd, activation_bits)
            if not layer.is_moe:
                quantize_linear(layer.mlp, "gate_up_proj", [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")],
                                quantized, sd, activation_bits)
                quantize_linear(layer.mlp, "down_proj", [p + "mlp.down_proj.weight"], quantized, sd, activation_bits)
        quantize_head(self, quantized, sd, activation_bits)

    def _rename_moe(self, sd: dict[str, torch.Tensor], p: str, quantized: dict[str, tuple[str, torch.Tensor]]) -> None:
        """One MoE layer's tensors to our names: mlp.gate.weight, mlp.w13 [E, 2I, H], mlp.w2 [E, H, I];
        or, where `quantized` holds the layer's stacked experts (gate|up in one type, down in one), QuantExperts on
        them."""
        a, e = self.args, self.args.num_experts
        if a.family == "GraniteMoeForCausalLM":
            m = p + "block_sparse_moe."
            router, w13, w2 = m + "router.layer.weight", m + "input_linear.weight", m + "output_linear.weight"
        else:
            m = p + ("block_sparse_moe." if a.family == "MixtralForCausalLM" else "mlp.")
            router, w13, w2 = m + "gate.weight", m + "experts.gate_up_proj", m + "experts.down_proj"
        sd[p + "mlp.gate.weight"] = take(sd, router)
        q13, q2 = quantized.get(w13), quantized.get(w2)
        if q13 is not None and q2 is not None:
            sd.pop(w13, None), sd.pop(w2, None)
            mlp = self.layers[int(p.split(".")[2])].mlp
            mlp.use_quantized_experts(QuantExperts(q13[1], q2[1], q13[0], a.hidden_size, a.moe_intermediate_size,
                                                   qtype2=q2[0]))
        elif a.family == "GraniteMoeForCausalLM":
            sd[p + "mlp.w13"] = take(sd, w13)  # [E, 2I, H], gate rows first
            sd[p + "mlp.w2"] = take(sd, w2)
        else:
            names = ("w1", "w3", "w2") if a.family == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
            sd[p + "mlp.w13"], sd[p + "mlp.w2"] = stack_experts(sd, m + "experts", *names, num_experts=e)
