"""The batch-1 decode fast path of the MoE decoder families (engine/models/moe_decoder.py: Qwen3-MoE,
Mixtral, OLMoE, GraniteMoE): one sequence, one new token on CPU, in kernels/decode_stack.py's one
C call with its MoE layers, where the module path pays per-layer host work (torch ops, Python) a
token at the shape of Granite-3.0-1B-A400M (issue 35: c=1 TPOT against llama-server on the same GGUF).

It applies where the C step computes what the module path computes: the weight_format "gguf"
model (experts on their GGUF blocks, QuantExperts; attention and dense MLPs on linear layers the
step takes, decode_fast_path.stack_linear) with float32 activations and caches, or a bf16 model on
the panel kernels (experts on fused_moe.ExpertPanels' copy, linear layers on PackedLinear's
panels: an AVX512-BF16 CPU without AMX); a softmax router with no score bias, group limit or hash,
no shared experts or SwiGLU clamp, no attention bias, no sliding window, no expert load counting.
Anything else keeps the module path. The router's logits are the module path's bits (the same
float32 fma chain as its panel kernel); the experts, SiLU and combine are kernels/qmoe.py's
arithmetic; the softmax over the chosen logits and the attention sum in their own order, so
logprobs agree to float32 rounding and tokens are the same (tests/models/test_moe_quantized.py).
A bf16 model's step rounds to bf16 wherever the module path holds a bf16 tensor: its logits are
the module path's bits (tests/models/test_moe_decode_bf16.py).
decode_fast_path.DecodeFastPath re-reads the model's state each step and rebuilds or drops the plan.
"""
from __future__ import annotations

import torch
from torch import nn

from moebus.kernels.decode_stack import (
    BF16,
    DecodeStack,
    StackExperts,
    StackLayer,
    StackShape,
    bf16_available,
    bf16_panels_ok,
    cpu_kernel_available,
)
from moebus.kernels.fused_moe import ExpertPanels
from moebus.kernels.lm_head_argmax import pack_panels
from moebus.platforms.cpu.decode_fast_path import DecodeFastPath, embedding_ok, gain, stack_linear


def moe_parts(model: nn.Module) -> list:
    """What the plan is built from, by identity: each layer's attention projections and its experts
    (QuantExperts, or bf16 experts' packed copy: repacked when an EPLB move writes the weights),
    load counter and router weight (or dense MLP)."""
    out: list = []
    for ly in model.layers._modules.values():
        attn, mlp = ly._modules["self_attn"]._modules, ly._modules["mlp"]
        out += (attn["qkv_proj"], attn["o_proj"])
        if ly.is_moe:  # an expert-parallel layer (EPMoE) has no quant_experts: no plan
            q = getattr(mlp, "quant_experts", None)
            packed = _bf16_packed(mlp) if q is None else None
            out += (q if q is not None else packed and packed[0], getattr(mlp, "load_counter", None),
                    mlp._modules["gate"]._parameters["weight"])
        else:
            out += (mlp._modules["gate_up_proj"], mlp._modules["down_proj"])
    return out


def _bf16_packed(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A bf16 MoE layer's (gate|up, down) panels in the copy its panel kernel reads (made here if
    not yet: fused_moe.ExpertPanels), or None."""
    w13, w2 = mlp._parameters.get("w13"), mlp._parameters.get("w2")
    if w13 is None or w13.dtype != torch.bfloat16 or not isinstance(getattr(mlp, "panels", None), ExpertPanels):
        return None
    return mlp.panels.get(w13, w2)


def _experts(mlp: nn.Module) -> StackExperts | None:
    q, gate = getattr(mlp, "quant_experts", None), mlp.gate
    if (mlp.shared_experts is not None or mlp.swiglu_limit is not None or gate.is_hash or gate.groups is not None
            or gate.e_score_correction_bias is not None or gate.scoring_func != "softmax"
            or getattr(mlp, "load_counter", None) is not None):
        return None
    w = gate.weight.detach().float().contiguous()
    route = (w, pack_panels(w), gate.top_k, gate.norm_topk_prob, float(gate.routed_scaling_factor))
    if q is not None:
        return StackExperts(*route, q.qtype, q.p13, q.p2, q.intermediate, q.qtype2) if q.p13.is_cpu else None
    if (packed := _bf16_packed(mlp)) is None or not bf16_available():
        return None
    p13, p2 = packed
    inter = mlp.w2.shape[2]
    if not (bf16_panels_ok(p13, 2 * inter, w.shape[1]) and bf16_panels_ok(p2, w.shape[1], inter)):
        return None
    return StackExperts(*route, BF16, p13, p2, inter)


def _layer(ly: nn.Module) -> StackLayer | None:
    attn = ly.self_attn
    qkv, o = stack_linear(attn.qkv_proj), stack_linear(attn.o_proj)
    norms = (gain(ly.input_layernorm.weight), gain(ly.post_attention_layernorm.weight))
    if qkv is None or o is None or attn.sliding_window is not None or None in norms:
        return None
    qk = (gain(attn.q_norm), gain(attn.k_norm)) if attn.qk_norm != "none" else (None, None)
    if attn.qk_norm != "none" and None in qk:
        return None
    mlp: tuple = (None, None)
    experts = None
    if ly.is_moe:
        if (experts := _experts(ly.mlp)) is None:
            return None
    else:
        mlp = (stack_linear(ly.mlp.gate_up_proj), stack_linear(ly.mlp.down_proj))
        if any(x is None for x in mlp):
            return None
    return StackLayer(norms[0], norms[1], qkv, o, *mlp, q_norm=qk[0], k_norm=qk[1],
                      qk_norm=attn.qk_norm, clip=attn.clip, o_scale=float(attn.out_scale), experts=experts)


def build_moe_plan(model: nn.Module) -> DecodeStack | None:
    """The C step over this MoE decoder's weights, or None when some part of it is not supported."""
    a = model.args
    emb = model.embed_tokens.weight
    if not (cpu_kernel_available() and embedding_ok(emb) and (norm := gain(model.norm.weight)) is not None):
        return None
    layers = [_layer(ly) for ly in model.layers]
    scales = {ly.self_attn.scale for ly in model.layers}
    if any(x is None for x in layers) or len(scales) != 1:
        return None
    shape = StackShape(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps, a.rope_theta,
                       a.max_position_embeddings)
    return DecodeStack(layers, norm, shape, embed=emb.detach(), scale=scales.pop(), emb_scale=a.embedding_multiplier,
                       dtype=emb.dtype)


def moe_decode_fast_path() -> DecodeFastPath:
    return DecodeFastPath(build_moe_plan, moe_parts)
