"""The batch-1 decode fast path of the llama model: one sequence, one new token, on CPU, through
kernels/decode_stack.py's single C call instead of ~270 module calls (issue 21: per-token latency
at c=1, where no batch amortises the module path's host work).

It applies only where it computes what the module path computes: float32 activations and caches
on CPU, linear layers that are plain float32 nn.Linear / PackedLinear or QuantLinear (taking the
GEMV a 1-row call of theirs takes: QuantLinear.few_rows_activation_bits), no forward hooks, no
batch-invariant mode, no grad, no image embeddings, no windowed KV group. Every step re-reads that
state (DecodeFastPath), so swapping a linear layer, adding a hook or changing activation_bits
rebuilds or drops the plan; anything else falls back to the module path. Weights must be updated
in place (load_weights does), never replaced by new tensors: the plan holds their addresses.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from moebus.engine.attention import AttentionMetadata
from moebus.engine.cpu_linear import PackedLinear, QuantLinear
from moebus.kernels.decode_stack import DecodeStack, StackLayer, StackLinear, StackShape, cpu_kernel_available


def _linears(model: nn.Module) -> tuple[nn.Module, ...]:
    """Every layer's four linear modules, read from the _modules dicts (nn.Module.__getattr__ would
    cost ~100 us a step over 30 layers)."""
    out = []
    for ly in model.layers._modules.values():
        attn, mlp = ly._modules["self_attn"]._modules, ly._modules["mlp"]._modules
        out += (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"])
    return tuple(out)


def _hooked(model: nn.Module) -> bool:
    """Whether a forward hook (global or on any module) would see this step: the C call skips them."""
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _widths(lins: tuple[nn.Module, ...]) -> tuple:
    return tuple((m.activation_bits, m.batch_invariant) if type(m) is QuantLinear else None for m in lins)


def _stack_linear(m: nn.Module) -> StackLinear | None:
    if type(m) is QuantLinear:
        w = m.qweight
        if w.device.type != "cpu" or m.batch_invariant:
            return None
        return StackLinear(w, m.in_features, m.qtype, m.few_rows_activation_bits())
    if type(m) in (nn.Linear, PackedLinear) and m.bias is None:
        w = m.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous():
            return StackLinear(w.detach(), m.in_features)
    return None


def _norm_ok(n: nn.Module) -> bool:
    w = n.weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()


def build_plan(model: nn.Module) -> DecodeStack | None:
    """The C step over this model's weights, or None when some part of it is not supported."""
    a = model.args
    emb = model.embed_tokens.weight
    if not cpu_kernel_available() or emb.device.type != "cpu" or emb.dtype != torch.float32 or not _norm_ok(
            model.norm):
        return None
    layers = []
    for ly in model.layers:
        lins = [_stack_linear(m) for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj,
                                           ly.mlp.down_proj)]
        if any(x is None for x in lins) or not (_norm_ok(ly.input_layernorm) and _norm_ok(
                ly.post_attention_layernorm)) or ly.self_attn.scale != a.head_dim**-0.5:
            return None
        layers.append(StackLayer(ly.input_layernorm.weight.detach(), ly.post_attention_layernorm.weight.detach(),
                                 *lins))
    shape = StackShape(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps, a.rope_theta,
                       a.max_position_embeddings)
    return DecodeStack(layers, model.norm.weight.detach(), shape)


class DecodeFastPath:
    """Per model: the plan for its current state, rebuilt when that state changes. The state is the
    linear modules, their activation widths and whether anything is hooked; hooks are rescanned
    only when torch has handed out a hook handle since the last scan (RemovableHandle.next_id), or
    while one was found (so a removed hook gives the fast path back)."""

    def __init__(self) -> None:
        self._state: tuple | None = None
        self._plan: DecodeStack | None = None
        self._hook_id, self._hooked = -1, True

    def _current(self, model: nn.Module) -> tuple:
        if self._hooked or RemovableHandle.next_id != self._hook_id:
            self._hook_id, self._hooked = RemovableHandle.next_id, _hooked(model)
        lins = _linears(model)
        return lins, _widths(lins), self._hooked

    def __call__(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The hidden state [1, hidden] of this step, or None: take the module path."""
        if (input_ids.shape != (1,) or input_ids.device.type != "cpu" or meta.query_start_loc != [0, 1]
                or meta.batch_invariant or meta.window is not None or torch.is_grad_enabled()):
            return None
        kc, vc = kv_caches[0][:2]
        a = model.args
        if (kc.dtype != torch.float32 or vc.dtype != torch.float32 or not (kc.is_contiguous() and vc.is_contiguous())
                or kc.device.type != "cpu" or kc.shape[2:] != (a.num_key_value_heads, a.head_dim)
                or vc.shape != kc.shape):
            return None
        state = self._current(model)
        if state != self._state:
            self._state, self._plan = state, None if state[-1] else build_plan(model)
        plan = self._plan
        table, seq_len = meta.block_tables[0], meta.seq_lens[0]
        if (plan is None or table.dtype != torch.int32 or not table.is_contiguous()
                or seq_len > table.shape[0] * kc.shape[1] or len(kv_caches) != len(model.layers)):
            return None
        h = model.embed_tokens.weight[int(input_ids[0])].clone()
        out = plan.step(h, int(positions[0]), int(meta.slot_mapping[0]), seq_len, table, kv_caches)
        return None if out is None else out.view(1, -1)
