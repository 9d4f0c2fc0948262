"""The batch-1 decode fast path of the llama model (engine/models/llama.py): one sequence, one new
token, on CPU, through kernels/decode_stack.py's single C call instead of ~270 module calls (issue
21: per-token latency at c=1, where no batch amortises the module path's host work).

It applies only where it computes what the module path computes: float32 activations and caches
on CPU, linear layers that are plain float32 nn.Linear / PackedLinear or QuantLinear (taking the
GEMV a 1-row call of theirs takes: its panels, or QuantLinear.few_rows_activation_bits), or a bf16
model on an AVX512-BF16 CPU without AMX (bf16 caches; its PackedLinears on the panels their kernel
reads, every bf16 tensor of the module path rounded at the same point: the module path's bits,
tests/engine/test_llama_decode_fast_path.py), no forward hooks, no
batch-invariant mode, no grad, no image embeddings, no windowed KV group. Every step re-reads that
state (DecodeFastPath), so swapping a linear layer, adding a hook or changing activation_bits
rebuilds or drops the plan; anything else falls back to the module path. Weights must be updated
in place (load_weights does), never replaced by new tensors: the plan holds their addresses (and
those of the KV caches, taken again when the cache list holds other entries). The token, position
and slot are read from the step's int64 tensors and the embedding row looked up inside the C call.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from moebus.engine.attention import AttentionMetadata
from moebus.engine.quant_linear import QuantLinear
from moebus.kernels.decode_stack import (
    DecodeStack,
    StackLayer,
    StackLinear,
    StackShape,
    bf16_available,
    bf16_panels_ok,
    cpu_kernel_available,
)
from moebus.platforms.cpu.packed_linear import PackedLinear

_SUBS = operator.itemgetter("self_attn", "mlp")
_ATTN = operator.itemgetter("qkv_proj", "o_proj")
_MLP = operator.itemgetter("gate_up_proj", "down_proj")
_WIDTH = operator.attrgetter("activation_bits", "batch_invariant")


def _linears(model: nn.Module) -> list[nn.Module]:
    """Every layer's four linear modules, read from the _modules dicts (nn.Module.__getattr__ is
    slow over 30 layers) by C-level getters: the decode step runs this every token."""
    out: list[nn.Module] = []
    for ly in model.layers._modules.values():
        attn, mlp = _SUBS(ly._modules)
        out += _ATTN(attn._modules)
        out += _MLP(mlp._modules)
    return out


def _hooked(model: nn.Module) -> bool:
    """Whether a forward hook (global or on any module) would see this step: the C call skips them."""
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in model.modules())




def stack_linear(m: nn.Module) -> StackLinear | None:
    """The C step's view of a linear module, or None where it takes no such layer."""
    if type(m) is QuantLinear:
        w = m.qweight
        if w.device.type != "cpu":
            return None
        if m.uses_panels():  # the panels' one formula: the module path's bits at any batch
            return StackLinear(w, m.in_features, m.qtype, 16, panels=m.panels)
        if m.batch_invariant:
            return None
        return StackLinear(w, m.in_features, m.qtype, m.few_rows_activation_bits())
    if type(m) in (nn.Linear, PackedLinear) and m.bias is None:
        w = m.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous():
            return StackLinear(w.detach(), m.in_features)
        panels = getattr(m, "panels", None)
        if (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.is_contiguous() and panels is not None
                and bf16_panels_ok(panels, *w.shape)):  # the panels the module path's kernel reads
            return StackLinear(w.detach(), m.in_features, panels=panels)
    return None


def float_ok(w: torch.Tensor) -> bool:
    """A float32 CPU contiguous tensor (a norm's gain, an embedding): what the C step reads."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous()


def gain(w: torch.Tensor) -> torch.Tensor | None:
    """A norm's gain as the C step reads it (float32), or None: a float32 one itself, a bf16 one
    converted (a copy: [hidden] floats, taken again when the plan is rebuilt)."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    return w.detach().float().contiguous()


def embedding_ok(emb: torch.Tensor) -> bool:
    """A float32 embedding, or a bf16 one where the build takes bf16 models: the model's dtype."""
    return float_ok(emb) or (emb.dtype == torch.bfloat16 and emb.is_cpu and emb.is_contiguous()
                             and bf16_available())


def build_plan(model: nn.Module) -> DecodeStack | None:
    """The C step over this model's weights, or None when some part of it is not supported."""
    a = model.args
    emb = model.embed_tokens.weight
    if not cpu_kernel_available() or not embedding_ok(emb) or (norm := gain(model.norm.weight)) is None:
        return None
    layers = []
    for ly in model.layers:
        lins = [stack_linear(m) for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj,
                                           ly.mlp.down_proj)]
        norms = (gain(ly.input_layernorm.weight), gain(ly.post_attention_layernorm.weight))
        if any(x is None for x in lins) or None in norms or ly.self_attn.scale != a.head_dim**-0.5:
            return None
        layers.append(StackLayer(*norms, *lins))
    shape = StackShape(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps, a.rope_theta,
                       a.max_position_embeddings)
    return DecodeStack(layers, norm, shape, embed=emb.detach(), dtype=emb.dtype)


class DecodeFastPath:
    """Per model: the plan for its current state, rebuilt when that state changes. The state is the
    model's weight-holding parts (`parts`: for a llama its linear modules) and the embedding weight
    (by identity), the QuantLinear ones' activation widths and whether anything is hooked; hooks
    are rescanned only when torch has handed out a hook handle since the last scan
    (RemovableHandle.next_id), or while one was found (so a removed hook gives the fast path back).
    `build` makes the plan (None: this model's state is not supported)."""

    def __init__(self, build: Callable[[nn.Module], DecodeStack | None] = build_plan,
                 parts: Callable[[nn.Module], list] = _linears) -> None:
        self._build, self._parts = build, parts
        self._lins: list[nn.Module] = []
        self._quants: list[QuantLinear] = []
        self._widths: list[tuple] = []
        self._emb: torch.Tensor | None = None
        self._plan: DecodeStack | None = None
        self._hook_id, self._hooked = -1, True

    def _plan_for(self, model: nn.Module) -> DecodeStack | None:
        """The plan, rebuilt first if the state changed (C-level comparisons: ~120 modules a token)."""
        if self._hooked or RemovableHandle.next_id != self._hook_id:
            hooked = _hooked(model)
            if hooked != self._hooked:
                self._lins = []  # rebuild (or drop) below
            self._hook_id, self._hooked = RemovableHandle.next_id, hooked
        lins, emb = self._parts(model), model._modules["embed_tokens"]._parameters["weight"]
        if (len(lins) != len(self._lins) or any(map(operator.is_not, lins, self._lins))
                or list(map(_WIDTH, self._quants)) != self._widths or emb is not self._emb):
            self._lins, self._quants, self._emb = lins, [m for m in lins if type(m) is QuantLinear], emb
            self._widths = list(map(_WIDTH, self._quants))
            self._plan = None if self._hooked else self._build(model)
        return self._plan

    def __call__(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The hidden state [1, hidden] of this step, or None: take the module path."""
        if (input_ids.shape != (1,) or input_ids.device.type != "cpu" or meta.query_start_loc != [0, 1]
                or meta.batch_invariant or meta.window is not None or torch.is_grad_enabled()):
            return None
        kc, vc = kv_caches[0][:2]
        a = model.args
        if (not (kc.is_contiguous() and vc.is_contiguous()) or kc.device.type != "cpu"
                or kc.shape[2:] != (a.num_key_value_heads, a.head_dim) or vc.shape != kc.shape):
            return None
        plan = self._plan_for(model)
        table, seq_len, slots = meta.block_tables, meta.seq_lens[0], meta.slot_mapping
        if (plan is None or kc.dtype != plan.dtype or vc.dtype != plan.dtype or table.dtype != torch.int32
                or not table.is_contiguous() or table.shape[0] != 1
                or seq_len > table.shape[1] * kc.shape[1] or len(kv_caches) != len(model.layers)
                or input_ids.dtype != torch.int64 or positions.dtype != torch.int64 or not positions.is_cpu
                or slots.dtype != torch.int64 or not slots.is_cpu or positions.numel() != 1 or slots.numel() != 1):
            return None
        out = plan.step_ids(input_ids, positions, slots, seq_len, table, kv_caches)
        return None if out is None else out.view(1, -1).to(plan.dtype)  # bf16: the module path's final norm
