"""DeepSeek-V2 / V3 MoE LMs on the paged attention backend (reference: HF DeepseekV2/V3ForCausalLM).

Every layer: RMSNorm -> MLA attention (mla_attention: only the latent is cached) -> RMSNorm ->
MLP. The first `first_k_dense_replace` layers (and, in V2, those off `moe_layer_freq`) use a dense
SwiGLU MLP; the rest a DeepSeek MoE (models/moe.py): routed experts + shared experts. Routing:

- V2: softmax scores, no score bias; `greedy` top-k, or `group_limited_greedy` (top-k within the
  `topk_group` groups whose best expert scores highest). `norm_topk_prob` is applied, as in
  DeepSeek's code and vLLM; HF's V2 ignores it, so V2 parity checkpoints set it False.
- V3 (`noaux_tc`): sigmoid scores; choice by scores + `e_score_correction_bias` within the
  `topk_group` groups with the best top-2 sums; weights are the unbiased scores.

RoPE is plain or YaRN (`rope_parameters`, or the older `rope_theta` + `rope_scaling`). With YaRN the
rotated channels carry the attention factor (given, or inferred from `mscale` / `mscale_all_dim`
like HF) and the softmax scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2.

Multi-token-prediction layers of a release checkpoint (`model.layers.{n..n+k-1}` for k =
`num_nextn_predict_layers`) are set aside in `self.mtp_weights`, unused. Quantized checkpoints (the
FP8 block-scaled releases) are refused: their config carries `quantization_config`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, KVCacheSpec
from moebus.engine.lm_head import float_logits
from moebus.engine.models.deepseek_v4_rope import RopeSpec
from moebus.engine.models.llama import LlamaMLP, RMSNorm
from moebus.engine.models.mla_attention import MLAttention
from moebus.engine.models.moe import GroupLimit, MoE
from moebus.engine.models.quant_experts import QuantExperts
from moebus.engine.models.weights import (
    assign,
    fuse,
    quant_linear_of,
    quantize_head,
    quantize_linear,
    stack_experts,
)

FAMILIES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
_TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
_SCORING = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
# HF DeepseekV2Config's defaults where they differ from V3's (the dataclass defaults below).
_V2_DEFAULTS = dict(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, n_group=None,
                    topk_group=None, routed_scaling_factor=1.0, first_k_dense_replace=0, n_shared_experts=2)
_NULLABLE = ("q_lora_rank", "n_group", "topk_group", "n_routed_experts", "rope_scaling")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(slots=True)
class DeepseekV2Args:
    """Hyper-parameters; every field is the config.json key of the same name. Defaults are HF
    DeepseekV3Config's; `from_hf_config` swaps in V2's for a V2 config."""

    model_type: str = "deepseek_v3"  # deepseek_v2 | deepseek_v3: picks the router family
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense layers' MLP width
    moe_intermediate_size: int = 2048  # per routed expert; shared MLP = n_shared_experts * this
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: one q_proj (V2-Lite)
    kv_lora_rank: int = 512  # the cached latent's width
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256  # None: every layer dense
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1  # V2: MoE only in layers i % freq == 0 (HF ignores it; released configs use 1)
    topk_method: str = "noaux_tc"
    n_group: int | None = 8
    topk_group: int | None = 4
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the YaRN parameters; None: plain rope
    rope_interleave: bool = True  # rope on interleaved channel pairs (V2: always)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in _TOPK_METHODS:
            raise ValueError(f"model_type must be one of {sorted(_TOPK_METHODS)}, not {self.model_type!r}")
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name):
                raise ValueError(f"{name}=True is not supported")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', not {self.hidden_act!r}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ValueError(f"qk_rope_head_dim must be even and > 0, not {self.qk_rope_head_dim}")
        if self.topk_method not in _TOPK_METHODS[self.model_type]:
            raise ValueError(f"topk_method {self.topk_method!r}: {self.model_type} takes {_TOPK_METHODS[self.model_type]}")
        if self.scoring_func != _SCORING[self.model_type]:
            raise ValueError(f"scoring_func {self.scoring_func!r}: {self.model_type} scores with "
                             f"{_SCORING[self.model_type]!r}")
        if self.n_routed_experts is not None and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError("need 1 <= num_experts_per_tok <= n_routed_experts")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, not {self.moe_layer_freq}")
        self.groups()  # checked when the MoE is built; fail here, before any tensor is allocated
        self.rope()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    def groups(self) -> GroupLimit | None:
        if self.model_type == "deepseek_v2" and self.topk_method == "group_limited_greedy":
            limit = GroupLimit(self.n_group or 0, self.topk_group or 0, "max")
        elif self.model_type == "deepseek_v3" and (self.n_group or 1) > 1:
            limit = GroupLimit(self.n_group, self.topk_group or 0, "top2_sum")
        else:
            return None
        if self.n_routed_experts is not None:
            limit.check(self.n_routed_experts, self.num_experts_per_tok)
        return limit

    def rope(self) -> RopeSpec:
        p = self.rope_scaling
        if p is None:
            return RopeSpec(self.rope_theta)
        kind = p.get("rope_type", p.get("type"))
        if kind != "yarn":
            raise ValueError(f"unsupported rope_parameters.rope_type {kind!r}: DeepSeek-V2/V3 take 'default' or 'yarn'")
        if not p.get("truncate", True):
            raise ValueError("rope_parameters.truncate=False is not supported")
        orig = p.get("original_max_position_embeddings")
        if not orig:
            raise ValueError("yarn rope needs rope_parameters.original_max_position_embeddings")
        factor = self._yarn_factor()
        attention_factor = p.get("attention_factor")
        if attention_factor is None:  # HF's inference (modeling_rope_utils._compute_yarn_parameters)
            ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
            attention_factor = (yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all
                                else yarn_mscale(factor))
        return RopeSpec(self.rope_theta, factor, int(orig), float(p.get("beta_fast") or 32),
                        float(p.get("beta_slow") or 1), float(attention_factor))

    def _yarn_factor(self) -> float:
        p = self.rope_scaling or {}
        if p.get("factor") is None:
            return self.max_position_embeddings / p["original_max_position_embeddings"]
        return float(p["factor"])

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN (HF yarn_apply_mscale)."""
        scale = self.qk_head_dim ** -0.5
        ms_all = (self.rope_scaling or {}).get("mscale_all_dim")
        if self.rope_scaling is not None and ms_all:
            scale *= yarn_mscale(self._yarn_factor(), ms_all) ** 2
        return scale

    @classmethod
    def from_hf_config(cls, config: dict) -> DeepseekV2Args:
        """Read an HF config.json dict (transformers 5 `rope_parameters`, or `rope_theta` + `rope_scaling`)."""
        cfg = dict(config)
        if cfg.get("quantization_config"):
            raise ValueError("quantization_config: quantized (e.g. FP8 block-scaled) checkpoints are not supported")
        arch = (cfg.get("architectures") or [None])[0]
        cfg["model_type"] = cfg.get("model_type") or FAMILIES.get(arch)
        default = {f.name: f.default for f in fields(cls)}  # slotted: no class-level defaults
        if cfg["model_type"] == "deepseek_v2":
            default.update(_V2_DEFAULTS)
            cfg.pop("rope_interleave", None)  # V2 always rotates interleaved pairs
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta"))
        cfg["rope_scaling"] = None if kind == "default" else {**rope, "rope_type": kind}
        kw = {k: cfg[k] for k in default if k in cfg and (cfg[k] is not None or k in _NULLABLE)}
        return cls(**{**default, **kw})


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, a: DeepseekV2Args, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a.hidden_size, a.num_attention_heads, a.q_lora_rank, a.kv_lora_rank,
                                     a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.rms_norm_eps,
                                     a.softmax_scale, interleaved=a.rope_interleave)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.is_moe = a.is_moe_layer(i)
        if self.is_moe:
            v3 = a.model_type == "deepseek_v3"
            self.mlp = MoE(a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                           a.n_shared_experts, a.scoring_func, a.norm_topk_prob, a.routed_scaling_factor,
                           swiglu_limit=None, hash_vocab_size=None, score_bias=v3, groups=a.groups())
        else:
            self.mlp = LlamaMLP(a.hidden_size, a.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, input_ids: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.mlp(x, input_ids) if self.is_moe else self.mlp(x)), residual


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, args: DeepseekV2Args):
        super().__init__()
        self.args = args
        self.rope = args.rope()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One latent head per token, [c_kv | k_pe]; V is read from K's first kv_lora_rank channels."""
        return [KVCacheSpec(1, layer.self_attn.cache_dim, 0) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions, self.args.qk_rope_head_dim, torch.float32)
        x, residual = self.embed_tokens(input_ids), None
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
        """Load the tensors as HF's save_pretrained writes them (per-expert `mlp.experts.E.*`, or
        stacked as a GGUF's converted copy has them); strict: the first missing, unexpected or
        misshaped tensor fails the load, named. `quantized` (HF name -> (GGUF type, blocks), as
        loader/gguf_file.py's quantized_blocks gives them): a layer's routed experts run on those
        blocks (QuantExperts), and so do the attention's projections, the dense MLPs, the shared
        experts and the LM head where whole (QuantLinear, with activation_bits). kv_b_proj (a GGUF's
        per-head attn_k_b / attn_v_b) stays dense."""
        a, q = self.args, quantized or {}
        sd = dict(state_dict)
        self.mtp_weights = {k: sd.pop(k) for k in list(sd) if self._is_mtp(k)}
        if self.lm_head is None:
            sd.pop("lm_head.weight", None)  # tied: HF may or may not write the copy
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            for leaf, own in attn.named_parameters():
                name = p + "self_attn." + leaf
                if name in sd and sd[name].shape == own.shape:  # misshaped: left for assign to name
                    sd[name] = attn.hf_to_local(leaf, sd[name])
            mlp = layer.mlp
            if layer.is_moe:
                q13, q2 = q.get(p + "mlp.experts.gate_up_proj"), q.get(p + "mlp.experts.down_proj")
                if q13 is not None and q2 is not None:  # their dense copies were never read (load_model)
                    mlp.use_quantized_experts(QuantExperts(q13[1], q2[1], q13[0], a.hidden_size,
                                                           a.moe_intermediate_size, qtype2=q2[0]))
                else:
                    sd[p + "mlp.w13"], sd[p + "mlp.w2"] = stack_experts(
                        sd, p + "mlp.experts", "gate_proj", "up_proj", "down_proj", a.n_routed_experts)
                if mlp.shared_experts is not None:
                    s = p + "mlp.shared_experts."
                    fuse(sd, [s + "gate_proj.weight", s + "up_proj.weight"], s + "gate_up_proj",
                         mlp.shared_experts.gate_up_proj.shape)
                    fuse(sd, [s + "down_proj.weight"], s + "down_proj", mlp.shared_experts.down_proj.shape)
            else:
                fuse(sd, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], p + "mlp.gate_up_proj.weight",
                     mlp.gate_up_proj.weight.shape)
        assign(self, sd)
        if q:
            self._quantize_linears(q, activation_bits)

    def _quantize_linears(self, quantized: dict[str, tuple[str, torch.Tensor]], activation_bits: int | None) -> None:
        """The bias-free linear layers on their GGUF blocks where whole; a projection with rotary
        rows gets its blocks' rows in our rope order, as hf_to_local orders its dense weight."""
        done: dict[str, torch.Tensor] = {}  # loaded already: nothing left to pop
        for i, layer in enumerate(self.layers):
            p, attn = f"model.layers.{i}.", layer.self_attn
            for leaf in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
                name = p + f"self_attn.{leaf}.weight"
                if hasattr(attn, leaf) and name in quantized:
                    qtype, blocks = quantized[name]
                    local = {name: (qtype, attn.hf_to_local(leaf + ".weight", blocks).contiguous())}
                    quantize_linear(attn, leaf, [name], local, done, activation_bits)
            if not layer.is_moe:
                quantize_linear(layer.mlp, "gate_up_proj", [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")],
                                quantized, done, activation_bits)
                quantize_linear(layer.mlp, "down_proj", [p + "mlp.down_proj.weight"], quantized, done, activation_bits)
            elif (shared := layer.mlp.shared_experts) is not None:
                s, dev = p + "mlp.shared_experts.", shared.gate_up_proj.device
                gate_up = quant_linear_of([s + "gate_proj.weight", s + "up_proj.weight"], quantized,
                                          shared.gate_up_proj.shape[1], activation_bits, dev)
                down = quant_linear_of([s + "down_proj.weight"], quantized, shared.down_proj.shape[1],
                                       activation_bits, dev)
                if gate_up is not None and down is not None:
                    shared.use_blocks(gate_up, down)
        quantize_head(self, quantized, done, activation_bits)

    def _is_mtp(self, key: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", key)
        n = self.args.num_hidden_layers
        return m is not None and n <= int(m[1]) < n + self.args.num_nextn_predict_layers

