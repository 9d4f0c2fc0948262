"""What each GGUF architecture means in HF terms: the config a file's metadata describes, and the
HF on-disk name of each of its tensors.

Follows llama.cpp's converter (convert_hf_to_gguf.py): `llama` (dense, or Mixtral when it has
experts), `qwen3moe`, `olmoe`, `granitemoe` and `deepseek2` (DeepSeek-V2 / V3: kv_b_proj comes
split per head into attn_k_b / attn_v_b; rope rows stay interleaved as in HF's checkpoints). The `llama` and `granitemoe` converters interleave
each head's rotary halves in attn_q / attn_k (llama.cpp's "norm" RoPE); `qwen3moe` and `olmoe` keep
HF's layout (llama.cpp's "neox" RoPE). Experts come stacked (`ffn_{gate,up,down}_exps`, [E, I, H]
and [E, H, I]); they are emitted stacked under the names each family's loader takes. Metadata
llama.cpp does not write is what llama.cpp assumes: Qwen3-MoE renormalises its top-k weights,
OLMoE does not, and OLMoE's clip_qkv is read from `attention.clamp_kqv` when present.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Meta = Callable[[str, object], object]  # arch-scoped metadata lookup: (key, default) -> value

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # deepseek2 (MLA, shared experts)
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_MARKED = ("attn_k_b", "attn_v_b")  # deepseek2: kv_b_proj split per head, joined by stack_experts
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")


@dataclass(frozen=True, slots=True)
class GGUFArch:
    hf_architecture: Callable[[Meta], str]
    config: Callable[[Meta], dict]  # HF config fields beyond the common ones
    permuted_qk: bool  # q/k rows interleaved by the converter ("norm" RoPE)
    moe_prefix: str = "mlp"  # where the family's MoE tensors live
    router: str = "gate.weight"
    stacked: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")


def _experts(meta: Meta) -> dict:
    return {"num_experts_per_tok": int(meta("expert_used_count", 0))}


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(
        lambda m: "MixtralForCausalLM" if int(m("expert_count", 0)) else "LlamaForCausalLM",
        lambda m: ({"num_local_experts": int(m("expert_count")), **_experts(m)} if int(m("expert_count", 0)) else {}),
        permuted_qk=True, moe_prefix="block_sparse_moe"),
    "qwen3moe": GGUFArch(
        lambda m: "Qwen3MoeForCausalLM",
        lambda m: {"num_experts": int(m("expert_count")), **_experts(m), "norm_topk_prob": True,
                   "moe_intermediate_size": int(m("expert_feed_forward_length")),
                   "head_dim": int(m("attention.key_length")), "mlp_only_layers": [], "decoder_sparse_step": 1},
        permuted_qk=False),
    "olmoe": GGUFArch(
        lambda m: "OlmoeForCausalLM",
        lambda m: {"num_experts": int(m("expert_count")), **_experts(m), "norm_topk_prob": False,
                   "clip_qkv": m("attention.clamp_kqv", None)},
        permuted_qk=False),
    "granitemoe": GGUFArch(
        lambda m: "GraniteMoeForCausalLM",
        lambda m: {"num_local_experts": int(m("expert_count")), **_experts(m),
                   "attention_multiplier": float(m("attention.scale")),
                   "embedding_multiplier": float(m("embedding_scale")),
                   "residual_multiplier": float(m("residual_scale")), "logits_scaling": float(m("logit_scale"))},
        permuted_qk=True, moe_prefix="block_sparse_moe", router="router.layer.weight",
        stacked=("input_linear.weight", "output_linear.weight")),
}


def _deepseek2(m: Meta) -> dict:
    """MLA sizes from the `*_mla` keys (key_length / value_length describe the absorbed MQA view);
    sigmoid gating marks V3 (a file without the key is V2, as llama.cpp reads it)."""
    v3 = m("expert_gating_func", None) == 2  # gguf.ExpertGatingFuncType.SIGMOID
    rope, groups = int(m("rope.dimension_count")), int(m("expert_group_count", 0) or 1)
    cfg = {"num_key_value_heads": int(m("attention.head_count")), "head_dim": rope,
           "kv_lora_rank": int(m("attention.kv_lora_rank")), "q_lora_rank": m("attention.q_lora_rank", None) or None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": int(m("attention.key_length_mla")) - rope,
           "v_head_dim": int(m("attention.value_length_mla")), "n_routed_experts": int(m("expert_count")),
           **_experts(m), "moe_intermediate_size": int(m("expert_feed_forward_length")),
           "first_k_dense_replace": int(m("leading_dense_block_count", 0)),
           "n_shared_experts": int(m("expert_shared_count", 0)),
           "routed_scaling_factor": float(m("expert_weights_scale", 1.0)),
           "norm_topk_prob": bool(m("expert_weights_norm", False)), "n_group": groups,
           "topk_group": int(m("expert_group_used_count", 0) or 1), "rope_interleave": True,
           "scoring_func": "sigmoid" if v3 else "softmax",
           "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy")}
    if m("rope.scaling.type", None) == "yarn":  # llama.cpp writes yarn_log_multiplier = 0.1 * mscale_all_dim
        mscale = float(m("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        cfg["rope_scaling"] = {"type": "yarn", "factor": float(m("rope.scaling.factor")), "mscale": mscale,
                               "mscale_all_dim": mscale,
                               "original_max_position_embeddings": int(m("rope.scaling.original_context_length"))}
    return cfg


ARCHS["deepseek2"] = GGUFArch(
    lambda m: "DeepseekV3ForCausalLM" if m("expert_gating_func", None) == 2 else "DeepseekV2ForCausalLM",
    _deepseek2, permuted_qk=False)


# HF architecture -> config.json `model_type` (transformers' Auto classes need it)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
               "OlmoeForCausalLM": "olmoe", "GraniteMoeForCausalLM": "granitemoe",
               "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def arch_of(name: str) -> GGUFArch:
    if name not in ARCHS:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHS)}")
    return ARCHS[name]


def hf_name(arch: GGUFArch, name: str) -> str:
    """HF on-disk name of one GGUF tensor; expert tensors keep a marker name (`stack_experts` joins them)."""
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part == "exp_probs_b":
            return f"model.layers.{idx}.mlp.gate.e_score_correction_bias"
        if part in _MARKED:
            return f"model.layers.{idx}.{part}"  # joined by stack_experts
        if part in _EXPERT_PARTS:
            if part == "ffn_gate_inp":
                return f"model.layers.{idx}.{arch.moe_prefix}.{arch.router}"
            return f"model.layers.{idx}.{part}"  # joined by stack_experts
        if part not in _LAYER_NAMES:
            raise ValueError(f"GGUF tensor {name!r} has no HF counterpart for this architecture")
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no HF counterpart for this architecture")
    return f"{_TOP_NAMES[base]}.{suffix}"


def stack_experts(arch: GGUFArch, state: dict[str, torch.Tensor]) -> None:
    """Replaces each layer's ffn_{gate,up,down}_exps with the family's stacked names: gate_up
    [E, 2I, H] (gate rows first) and down [E, H, I]; and
    deepseek2's per-head attn_k_b [H, r, nope] / attn_v_b [H, v, r] with HF's kv_b_proj [H(nope + v), r]."""
    for i in sorted({k.split(".")[2] for k in state if k.endswith("attn_k_b")}, key=int):
        p = f"model.layers.{i}."
        k_b, v_b = state.pop(p + "attn_k_b"), state.pop(p + "attn_v_b", None)
        if v_b is None:
            raise KeyError(f"GGUF layer {i} lacks blk.{i}.attn_v_b.weight")
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        state[p + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
    layers = sorted({k.split(".")[2] for k in state if k.endswith("ffn_gate_exps")}, key=int)
    for i in layers:
        p = f"model.layers.{i}."
        parts = {n: state.pop(p + n, None) for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        missing = [n for n, t in parts.items() if t is None]
        if missing:
            raise KeyError(f"GGUF layer {i} lacks blk.{i}.{missing[0]}.weight")
        gate_up, down = arch.stacked
        state[f"{p}{arch.moe_prefix}.{gate_up}"] = torch.cat([parts["ffn_gate_exps"], parts["ffn_up_exps"]], dim=1)
        state[f"{p}{arch.moe_prefix}.{down}"] = parts["ffn_down_exps"]
