"""DeepSeek-V4(-Flash)-style MoE LM on the paged attention backend (reference: HF DeepseekV4).

Block structure (every layer): mHC streams -> collapse -> RMSNorm -> attention (shared K=V head,
sinks, grouped output projection) -> expand; mHC -> collapse -> RMSNorm -> MoE (hash-routed in the
`hash_moe` layers, learned top-k in the `moe` layers, plus shared expert) -> expand. After the last
layer the streams collapse (`hc_head`), then norm and `lm_head`.

Attention kinds (`layer_types`): `sliding_attention` (the window only, "main" rope),
`heavily_compressed_attention` (window + one compressed entry per `compress_rates[kind]` tokens)
and `compressed_sparse_attention` (window + the lightning indexer's top-`index_topk` entries of an
overlapping compressor); the compressed kinds rotate with the "compress" rope
(`compress_rope_theta`). Their paged state: deepseek_v4_compressor.

MTP: the `num_nextn_predict_layers` draft layers are not part of this module. `load_weights`
keeps any `mtp.*` tensors in `self.mtp_weights` (names untouched); deepseek_v4_mtp builds the nextn
layer from them, and engine/mtp_proposer drafts with it, fed the mHC streams entering `hc_head`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, CachePlane, KVCacheSpec
from moebus.engine.lm_head import float_logits
from moebus.engine.models.deepseek_v4_attention import DeepseekV4Attention, RMSNorm
from moebus.engine.models.deepseek_v4_compressor import Compressor, CompressPlan, Indexer, build_plan
from moebus.engine.models.deepseek_v4_rope import RopeSpec
from moebus.engine.models.deepseek_v4_sparse_attention import window_slots
from moebus.engine.models.hf_checkpoint import is_mtp_key, to_hf_names
from moebus.engine.models.hyper_connections import HyperConnection, HyperHead
from moebus.engine.models.moe import SCORING_FUNCS, MoE, enable_expert_load_counting

ATTENTION_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_KINDS = ("hash_moe", "moe")
_LEGACY_COMPRESS_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention",
                          128: "heavily_compressed_attention"}
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(slots=True)
class DeepseekV4Args:
    """Hyper-parameters; every field is the config.json key of the same name (HF DeepseekV4Config).

    Defaults are HF's (V4-Flash). `layer_types` / `mlp_layer_types` left None resolve like HF:
    2x HCA then CSA/HCA alternating, and 3x `hash_moe` then `moe`.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1  # shared-KV MQA: one head that is both K and V
    head_dim: int = 512
    partial_rotary_factor: float = 64 / 512  # rope channels per head = head_dim * this
    rope_theta: float = 10000.0  # RoPE base of the sliding-attention layers ("main" rope)
    q_lora_rank: int = 1024
    o_groups: int = 8  # head groups of the grouped output projection
    o_lora_rank: int = 1024  # per-group width of the grouped output projection
    sliding_window: int = 128  # tokens a query sees, itself included
    layer_types: list[str] | None = None  # per layer, one of ATTENTION_KINDS
    compress_rates: dict[str, int] | None = None  # tokens per compressed entry, per compressed kind
    compress_rope_theta: float = 160000.0  # RoPE base of the compressed layers ("compress" rope)
    compress_rope_scaling: dict | None = None  # HF's rope_parameters["compress"] when not plain (YaRN)
    index_n_heads: int = 64  # lightning indexer query heads
    index_head_dim: int = 128
    index_topk: int = 512  # compressed entries each CSA query attends
    mlp_layer_types: list[str] | None = None  # per layer, one of MLP_KINDS
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1  # shared MLP width = n_shared_experts * moe_intermediate_size
    scoring_func: str = "sqrtsoftplus"  # router activation: sqrtsoftplus | sigmoid | softmax
    norm_topk_prob: bool = True  # renormalise the k chosen scores to sum 1 (HF always does)
    routed_scaling_factor: float = 1.5
    swiglu_limit: float | None = 10.0  # clamp of gate (max) / up (+-) pre-activations; None = off
    hc_mult: int = 4  # mHC residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 1  # MTP layers in the checkpoint (deepseek_v4_mtp)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            alt = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                   for i in range(max(n - 2, 0))]
            self.layer_types = ["heavily_compressed_attention"] * min(n, 2) + alt
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0)
        self.layer_types, self.mlp_layer_types = list(self.layer_types), list(self.mlp_layer_types)
        self.compress_rates = {**_DEFAULT_COMPRESS_RATES, **(self.compress_rates or {})}
        if any(r < 1 for r in self.compress_rates.values()):
            raise ValueError(f"compress_rates must be >= 1, got {self.compress_rates}")
        if "compressed_sparse_attention" in self.layer_types and not (
                self.index_topk >= 1 and self.index_n_heads >= 1 and self.rope_dim <= self.index_head_dim):
            raise ValueError("CSA needs index_topk >= 1, index_n_heads >= 1 and index_head_dim >= the rope dim")
        for name, kinds, allowed in (("layer_types", self.layer_types, ATTENTION_KINDS),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_KINDS)):
            if len(kinds) != n:
                raise ValueError(f"{name} has {len(kinds)} entries for {n} layers")
            if bad := sorted(set(kinds) - set(allowed)):
                raise ValueError(f"{name}: unknown kinds {bad}; allowed {allowed}")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4 attention has exactly one shared K=V head (num_key_value_heads=1)")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")
        if self.head_dim % 2 or self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"need even head_dim and 0 < even rope dim <= head_dim, got "
                             f"{self.head_dim}, {self.rope_dim}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError("need 1 <= num_experts_per_tok <= n_routed_experts")
        if self.n_shared_experts < 0 or self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ValueError("need n_shared_experts >= 0, hc_mult >= 1, hc_sinkhorn_iters >= 1")
        if self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def main_rope(self) -> RopeSpec:
        return RopeSpec(self.rope_theta)

    @property
    def compress_rope(self) -> RopeSpec:
        return RopeSpec.from_hf(self.compress_rope_scaling or {}, self.compress_rope_theta)

    @classmethod
    def from_hf_config(cls, config: dict) -> DeepseekV4Args:
        """Read an HF config.json dict, folding in the legacy keys HF also accepts."""
        cfg = dict(config)
        default = {f.name: f.default for f in fields(cls)}  # slotted: no class-level defaults
        if cfg.get("layer_types") is None and cfg.get("compress_ratios") is not None:
            # the release lists the nextn layers' ratios after the main layers'; HF keeps the first n
            n = cfg.get("num_hidden_layers", default["num_hidden_layers"])
            cfg["layer_types"] = [_LEGACY_COMPRESS_RATIO[r] for r in cfg["compress_ratios"][:n]]
        if cfg.get("mlp_layer_types") is None and cfg.get("num_hash_layers") is not None:
            n, h = cfg.get("num_hidden_layers", default["num_hidden_layers"]), cfg["num_hash_layers"]
            cfg["mlp_layer_types"] = ["hash_moe"] * min(n, h) + ["moe"] * max(n - h, 0)
        if cfg.get("partial_rotary_factor") is None and cfg.get("qk_rope_head_dim") is not None:
            cfg["partial_rotary_factor"] = cfg["qk_rope_head_dim"] / cfg.get("head_dim", default["head_dim"])
        rates = dict(cfg.get("compress_rates") or {})
        for kind, legacy in (("compressed_sparse_attention", "compress_rate_csa"),
                             ("heavily_compressed_attention", "compress_rate_hca")):
            if cfg.get(legacy) is not None:
                rates[kind] = cfg[legacy]
        cfg["compress_rates"] = rates or None
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        compress_rope = rope.get("compress") if isinstance(rope.get("compress"), dict) else rope
        # a flat rope dict's rope_theta is the main one; HF gives the compress rope compress_rope_theta
        theta = compress_rope.get("rope_theta") if "compress" in rope else None
        cfg["compress_rope_theta"] = theta or cfg.get("compress_rope_theta") or default["compress_rope_theta"]
        compress_rope = {**compress_rope, "rope_theta": cfg["compress_rope_theta"]}
        spec = RopeSpec.from_hf(compress_rope, cfg["compress_rope_theta"])
        cfg["compress_rope_scaling"] = None if spec.yarn_factor is None else compress_rope
        main_rope = (cfg.get("rope_parameters") or {}).get("main")
        if isinstance(main_rope, dict):  # HF's nested form wins over the flat keys
            if main_rope.get("rope_type", "default") != "default":
                raise NotImplementedError(f"rope_type {main_rope['rope_type']!r} for sliding layers")
            cfg["rope_theta"] = main_rope.get("rope_theta", cfg.get("rope_theta"))
            cfg["partial_rotary_factor"] = main_rope.get("partial_rotary_factor",
                                                         cfg.get("partial_rotary_factor"))
        return cls(**{k: v for k, v in cfg.items() if k in default and v is not None})


@dataclass(slots=True)
class V4Step:
    """What every layer of one forward step shares."""

    meta: AttentionMetadata
    positions: torch.Tensor
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin): [0] main rope, [1] compress rope
    plans: dict[str, CompressPlan]  # per compressed kind present


def _compressor(a: DeepseekV4Args, kind: str) -> Compressor | None:
    if kind == "sliding_attention":
        return None
    rate, csa = a.compress_rates[kind], kind == "compressed_sparse_attention"
    indexer = Indexer(a.hidden_size, a.q_lora_rank, a.index_n_heads, a.index_head_dim, rate, a.index_topk,
                      a.rms_norm_eps) if csa else None
    return Compressor(a.hidden_size, a.head_dim, rate, csa, a.rms_norm_eps, indexer)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_idx: int):
        super().__init__()
        a, eps = args, args.rms_norm_eps
        self.attn_hc = HyperConnection(a.hidden_size, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, eps)
        self.ffn_hc = HyperConnection(a.hidden_size, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, eps)
        self.input_layernorm = RMSNorm(a.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, eps)
        self.kind = a.layer_types[layer_idx]
        self.self_attn = DeepseekV4Attention(a.hidden_size, a.num_attention_heads, a.head_dim, a.rope_dim,
                                             a.q_lora_rank, a.o_groups, a.o_lora_rank, a.sliding_window, eps,
                                             _compressor(a, self.kind))
        is_hash = a.mlp_layer_types[layer_idx] == "hash_moe"
        self.mlp = MoE(a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                       a.n_shared_experts, a.scoring_func, a.norm_topk_prob, a.routed_scaling_factor,
                       a.swiglu_limit, a.vocab_size if is_hash else None)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, step: V4Step,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, post, comb = self.attn_hc(streams)
        cos, sin = step.rope[self.kind != "sliding_attention"]
        out = self.self_attn(self.input_layernorm(x), cos, sin, step.meta, kv_cache, step.positions,
                             step.plans.get(self.kind))
        streams = HyperConnection.merge(streams, out, post, comb)
        x, post, comb = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), input_ids)
        return HyperConnection.merge(streams, out, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: DeepseekV4Args):
        super().__init__()
        self.config = config
        self.main_rope, self.compress_rope = config.main_rope, config.compress_rope
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Sliding layers: K and V planes (the shared head twice). Compressed layers: K only (V
        is read from K), then the compressor's per-token `kv | gate` rows and its entries, and for
        CSA the same two for the indexer (deepseek_v4_compressor)."""
        c = self.config
        specs = []
        for layer in self.layers:
            comp = layer.self_attn.compressor
            if comp is None:
                specs.append(KVCacheSpec(1, c.head_dim, c.head_dim, sliding_window=c.sliding_window))
                continue
            # a window closing at token p pools the rows of (p - span, p]: span = 2 * rate with overlap
            span = comp.rate * (2 if comp.overlap else 1)
            planes = [CachePlane(1, comp.src_dim, span), CachePlane(comp.rate, c.head_dim)]
            if comp.indexer is not None:
                planes += [CachePlane(1, comp.indexer.src_dim, 2 * comp.rate), CachePlane(comp.rate, c.index_head_dim)]
            specs.append(KVCacheSpec(1, c.head_dim, 0, sliding_window=c.sliding_window, planes=tuple(planes)))
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        c = self.config
        x = self.embed_tokens(input_ids)
        rope = [self.main_rope.cos_sin(positions, c.rope_dim, x.dtype)]
        kinds = set(c.layer_types) - {"sliding_attention"}
        if kinds:
            rope.append(self.compress_rope.cos_sin(positions, c.rope_dim, x.dtype))
        plans = {k: build_plan(meta, positions, c.compress_rates[k], k == "compressed_sparse_attention")
                 for k in kinds}
        window = window_slots(meta.windowed(), positions, c.sliding_window) if kinds else None  # one gather map per step
        for plan in plans.values():
            plan.cos, plan.sin = self.compress_rope.cos_sin(plan.positions, c.rope_dim, x.dtype)
            plan.window = window
        step = V4Step(meta, positions, rope, plans)
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            streams = layer(streams, input_ids, step, kv_cache)
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, never rounded to the weights' dtype (engine/lm_head.py)."""
        return float_logits(self.lm_head, self.embed_tokens, hidden)

    def enable_expert_load_counting(self) -> list[torch.Tensor]:
        """Start counting routed assignments; returns each layer's live `load_counter [E]`."""
        return enable_expert_load_counting(self.layers)

    def _hf_layout(self) -> dict[str, tuple[str, int, int]]:
        """HF name -> (our name, first row, row count) of the slice of ours it fills."""
        layout: dict[str, tuple[str, int, int]] = {}
        for name, t in self.state_dict().items():
            hf = "lm_head.weight" if name == "lm_head.weight" else f"model.{name}"
            if name.endswith("mlp.w13"):
                layout[hf.replace("mlp.w13", "mlp.experts.gate_up_proj")] = (name, 0, t.shape[0])
            elif name.endswith("mlp.w2"):
                layout[hf.replace("mlp.w2", "mlp.experts.down_proj")] = (name, 0, t.shape[0])
            elif name.endswith("shared_experts.gate_up_proj"):
                half = t.shape[0] // 2
                layout[hf.replace("gate_up_proj", "gate_proj.weight")] = (name, 0, half)
                layout[hf.replace("gate_up_proj", "up_proj.weight")] = (name, half, half)
            elif name.endswith("shared_experts.down_proj"):
                layout[hf + ".weight"] = (name, 0, t.shape[0])
            else:
                layout[hf] = (name, 0, t.shape[0])
        return layout

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF module-named tensors (`model.layers.N.self_attn.q_a_proj.weight`, ...) or the
        on-disk spelling (`layers.N.attn.wq_a.weight`, per-expert w1/w2/w3); strict."""
        layout = self._hf_layout()
        given = to_hf_names(state_dict)
        self.mtp_weights = {k: given.pop(k) for k in list(given) if is_mtp_key(k)}
        if self.lm_head is None:
            given.pop("lm_head.weight", None)  # tied: HF may or may not write the copy
        missing, unexpected = sorted(set(layout) - set(given)), sorted(set(given) - set(layout))
        if missing or unexpected:
            raise KeyError(f"DeepSeek-V4 checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        ours = self.state_dict()
        for hf_name, tensor in given.items():
            name, start, rows = layout[hf_name]
            dest = ours[name][start:start + rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            layer_path, sep, leaf = name.partition(".self_attn.")
            if sep:  # head channels go into the rotary kernel's layout
                tensor = self.get_submodule(layer_path + ".self_attn").hf_to_local(leaf, tensor)
            dest.copy_(tensor)
        for layer in self.layers:
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None and not 0 <= int(table.min()) <= int(table.max()) < layer.mlp.num_experts:
                raise ValueError(f"tid2eid holds expert ids outside [0, {layer.mlp.num_experts})")
