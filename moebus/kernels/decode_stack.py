"""A llama-style decoder stack's batch-1 decode step in one C call (csrc/decode_stack_cpu.c), CPU only.

One token: per layer RMSNorm -> QKV -> neox rotary -> K/V into the paged cache -> attention over
the sequence -> O + residual -> RMSNorm -> gate/up -> SiLU * up -> down + residual; then the final
RMSNorm. MoE decoder layers add their knobs (q/k norms, clipping, a softmax scale, an O scale) and
take routed experts in place of gate/up and down (StackExperts: a float32 router, experts on
kernels/qmoe.py's panels or bf16 pack_panels panels). Linear weights are float32 [N, K], bf16 [N, K]
taken on their pack_panels panels (inputs rounded to bf16, float32 sums), or GGUF blocks
(quant_matmul.py's layout) taken on integer activations of `act_bits` (quant_matmul_qa_ref) or on
float ones (quant_matmul_ref). Caches [blocks, block_size, Hkv, D], contiguous, float32, or bf16
for a bf16 model (DecodeStack(dtype=torch.bfloat16): its embedding bf16 too, and every value the
module path holds in a bf16 tensor rounded to bf16 at the same point: decode_stack_ref says where).
`decode_stack_ref` is the same step on the kernels' torch references (the spec; the C step's bf16
attention is the module path's paged kernel, whose sums run in another order than the reference's);
platforms/cpu/decode_fast_path.py (and moe_decode.py) decide when it applies.

Why: at batch 1 the module path's host work (~270 module calls and ~360 allocations a token on
SmolLM2) cost about as much as the GEMVs; no batch amortises it.
"""
from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_build import I64, PTR, library
from .lm_head_argmax import panels_shape, unpack_panels
from .paged_attention import paged_attention_decode_ref
from .qmoe import qmoe_cpu
from .qpanel import panel_bytes
from .quant_matmul import GGML_TYPES, check_weight, quant_matmul_qa_ref, quant_matmul_ref
from .rmsnorm import rms_norm_ref
from .rotary import apply_rotary_ref, rotary_cos_sin
from .silu_mul import silu_and_mul_ref

_SOURCE = "decode_stack_cpu.c"
_QK_NORMS = ("none", "head", "full")  # decode_stack_cpu.c's dlayer.qk_norm codes
_I32 = ctypes.c_int32
_W_PANEL = 64  # decode_stack_cpu.c's W_PANEL: kind = it + the GGUF type id for panels
_W_BF16 = 32  # decode_stack_cpu.c's W_BF16: bf16 pack_panels panels (a linear's kind, an expert's type)
BF16 = "bf16"  # StackExperts.qtype of bf16 experts on pack_panels panels (fused_moe.ExpertPanels' layout)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, in float32: what a bf16 GEMV's input is."""
    return x.to(torch.bfloat16).float()


def bf16_panels_ok(panels: torch.Tensor, n: int, k: int) -> bool:
    """bf16 pack_panels panels of [n, k] weights (the last three dims; more before them for experts),
    unpadded: the step's GEMVs take whole panels."""
    return (panels.dtype == torch.bfloat16 and panels.is_contiguous() and n % 16 == 0 and k % 32 == 0
            and tuple(panels.shape[-3:]) == panels_shape(n, k, torch.bfloat16))


class _Linear(ctypes.Structure):
    _fields_ = [("w", PTR), ("ws", I64), ("kind", _I32), ("bits", _I32), ("n", _I32), ("k", _I32)]


class _Moe(ctypes.Structure):
    _fields_ = [("router", PTR), ("p13", PTR), ("p2", PTR), ("qt", _I32), ("qt2", _I32), ("n_experts", _I32),
                ("top_k", _I32), ("inter", _I32), ("renorm", _I32), ("route_scale", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", PTR), ("post_norm", PTR), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("q_norm", PTR), ("k_norm", PTR), ("qk_norm", _I32), ("clip", ctypes.c_float),
                ("o_scale", ctypes.c_float), ("moe", _Moe)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", _I32), ("hidden", _I32), ("inter", _I32), ("nh", _I32), ("nkv", _I32), ("hd", _I32),
                ("block_size", _I32), ("max_pos", _I32), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("final_norm", PTR), ("cos", PTR), ("sin", PTR), ("layers", ctypes.POINTER(_Layer)),
                ("emb_scale", ctypes.c_float), ("max_experts", _I32), ("max_k", _I32), ("max_moe_inter", _I32),
                ("bf16", _I32)]


@dataclass(frozen=True, slots=True)
class StackLinear:
    weight: torch.Tensor  # float32 or bf16 [N, K], or uint8 GGUF blocks [N, K / 32 * block bytes]
    in_features: int
    qtype: str | None = None  # None: a float32 or bf16 weight
    act_bits: int | None = None  # GGUF: 8 / 16-bit integer activations, None: float activations
    # GGUF on 16 bits: the weight in qpanel.py's layout; bf16: in pack_panels' (the step reads these)
    panels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        w = self.weight
        assert w.device.type == "cpu" and w.is_contiguous(), "CPU, contiguous weights"
        if self.qtype is None and w.dtype == torch.bfloat16:
            assert self.panels is not None and bf16_panels_ok(self.panels, w.shape[0], self.in_features), (
                "bf16: unpadded pack_panels panels", w.shape)
            assert self.act_bits is None
            return
        if self.qtype is None:
            assert w.dtype == torch.float32 and w.shape[1] == self.in_features, (w.dtype, w.shape)
            assert self.act_bits is None
        else:
            check_weight(w, self.qtype, self.in_features)
            assert self.act_bits in (None, 8, 16), self.act_bits
        if self.panels is not None:
            assert self.qtype is not None and self.act_bits == 16, "panels: GGUF weights on 16-bit activations"
            assert self.panels.numel() == panel_bytes(self.qtype, w.shape[0], self.in_features), self.panels.shape

    def ref(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is None and self.weight.dtype == torch.bfloat16:
            return F.linear(_bf16(x), self.weight.float())
        if self.qtype is None:
            return F.linear(x, self.weight)
        if self.act_bits:
            return quant_matmul_qa_ref(x, self.weight, self.qtype, self.act_bits)
        return quant_matmul_ref(x, self.weight, self.qtype)

    def struct(self) -> _Linear:
        w = self.weight
        if self.panels is not None and self.qtype is None:
            return _Linear(self.panels.data_ptr(), 0, _W_BF16, 0, w.shape[0], self.in_features)
        if self.panels is not None:
            return _Linear(self.panels.data_ptr(), 0, _W_PANEL + GGML_TYPES[self.qtype], 16, w.shape[0],
                           self.in_features)
        kind = 0 if self.qtype is None else GGML_TYPES[self.qtype]
        return _Linear(w.data_ptr(), w.stride(0) * w.element_size(), kind, self.act_bits or 0, w.shape[0],
                       self.in_features)


@dataclass(frozen=True, slots=True)
class StackExperts:
    """An MoE layer's router and routed experts: kernels/qmoe.py's panels of GGUF blocks, or (qtype
    BF16) bf16 experts on pack_panels panels, each expert's input rounded to bf16, float32 sums."""
    router: torch.Tensor  # float32 [E, hidden]
    router_panels: torch.Tensor  # the same in lm_head_argmax.pack_panels' float32 layout (what the step reads)
    top_k: int
    renorm: bool  # softmax over the top-k logits (== softmax, top-k, renormalise); else softmax over all E
    route_scale: float
    qtype: str  # gate|up's block type, or BF16
    p13: torch.Tensor  # uint8 [E, panel bytes of 2I x hidden]; BF16: bf16 [E, *panels_shape(2I, hidden)]
    p2: torch.Tensor  # uint8 [E, panel bytes of hidden x I]; BF16: bf16 [E, *panels_shape(hidden, I)]
    inter: int
    qtype2: str | None = None  # down's block type (None: qtype)

    @property
    def down_type(self) -> str:
        return self.qtype2 or self.qtype

    def __post_init__(self) -> None:
        e, hidden = self.router.shape
        assert self.router_panels.shape == (-(-e // 16), hidden, 16), self.router_panels.shape
        if self.qtype == BF16:
            assert self.down_type == BF16 and self.p13.shape[0] == self.p2.shape[0] == e
            assert bf16_panels_ok(self.p13, 2 * self.inter, hidden) and bf16_panels_ok(self.p2, hidden, self.inter)
        else:
            assert self.p13.shape == (e, panel_bytes(self.qtype, 2 * self.inter, hidden)), self.p13.shape
            assert self.p2.shape == (e, panel_bytes(self.down_type, hidden, self.inter)), self.p2.shape
        assert 1 <= self.top_k <= e and hidden % 32 == 0 and self.inter % 32 == 0

    def ref(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, hidden]: the router in float32, then the experts on kernels/qmoe.py's kernel (its
        tests hold it to qmoe_ref)."""
        logits = F.linear(x, self.router)
        if self.renorm:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.qtype == BF16:
            return self._bf16_ref(x, weights * self.route_scale, ids[0])
        out = qmoe_cpu(x, self.p13, self.p2, self.qtype, weights * self.route_scale, ids, self.inter,
                       qtype2=self.down_type)
        assert out is not None, "csrc/qmoe_cpu.c"
        return out

    def _bf16_ref(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """BF16 experts for x [1, hidden], as kernels/fused_moe.py's panel kernel: gate|up rounded to
        bf16, SiLU(gate) * up in float32 rounded to bf16, down rounded to bf16, the k outputs
        combined in float32 in top-k order, rounded to bf16."""
        hidden, inter = self.router.shape[1], self.inter
        out = torch.zeros(1, hidden)
        for j, e in enumerate(ids.tolist()):
            w13 = unpack_panels(self.p13[e], 2 * inter, hidden).float()
            w2 = unpack_panels(self.p2[e], hidden, inter).float()
            act = _bf16(silu_and_mul_ref(_bf16(F.linear(_bf16(x), w13))))
            out = out + weights[0, j] * _bf16(F.linear(act, w2))
        return _bf16(out)

    def struct(self) -> _Moe:
        types = (_W_BF16, _W_BF16) if self.qtype == BF16 else (GGML_TYPES[self.qtype], GGML_TYPES[self.down_type])
        return _Moe(self.router_panels.data_ptr(), self.p13.data_ptr(), self.p2.data_ptr(), *types,
                    self.router.shape[0], self.top_k, self.inter, int(self.renorm), self.route_scale)


@dataclass(frozen=True, slots=True)
class StackLayer:
    in_norm: torch.Tensor  # float32 [hidden]
    post_norm: torch.Tensor
    qkv: StackLinear  # [(Hq + 2 Hkv) D, hidden]: q, k, v rows in that order
    o: StackLinear
    gate_up: StackLinear | None  # [2 I, hidden]: gate rows, then up rows (None: experts)
    down: StackLinear | None
    q_norm: torch.Tensor | None = None  # float32: [D] (qk_norm "head") or [Hq D] ("full")
    k_norm: torch.Tensor | None = None  # [D] or [Hkv D]
    qk_norm: str = "none"  # "none" | "head" (RMSNorm per head) | "full" (over the whole projection)
    clip: float | None = None  # q, k, v clamped to [-clip, clip] after the norms
    o_scale: float = 1.0  # O's output times this before the residual add
    experts: StackExperts | None = None  # in place of gate_up / down

    def __post_init__(self) -> None:
        assert (self.experts is None) == (self.gate_up is not None and self.down is not None), "an MLP or experts"
        assert self.qk_norm in _QK_NORMS and (self.qk_norm == "none") == (self.q_norm is None is self.k_norm)

    def struct(self) -> _Layer:
        empty = _Linear(None, 0, 0, 0, 0, 0)
        mlp = (self.gate_up.struct(), self.down.struct()) if self.experts is None else (empty, empty)
        return _Layer(self.in_norm.data_ptr(), self.post_norm.data_ptr(), self.qkv.struct(), self.o.struct(), *mlp,
                      None if self.q_norm is None else self.q_norm.data_ptr(),
                      None if self.k_norm is None else self.k_norm.data_ptr(), _QK_NORMS.index(self.qk_norm),
                      self.clip or 0.0, self.o_scale, _Moe() if self.experts is None else self.experts.struct())


@dataclass(frozen=True, slots=True)
class StackShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    max_positions: int  # positions the rotary table covers

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"unsupported head layout {self}")


def decode_stack_ref(layers: list[StackLayer], final_norm: torch.Tensor, shape: StackShape, h: torch.Tensor,
                     pos: int, slot: int, seq_len: int, table: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step on the torch references: (final_norm(h'), h') for h [hidden], the residual stream h'.
    scale: the softmax scale (default head_dim ** -0.5). bf16 caches: a bf16 model's step, every
    value rounded (r) where the module path's tensor is bf16."""
    nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    cos, sin = rotary_cos_sin(torch.tensor([pos]), hd, shape.rope_theta)
    r = _bf16 if kv_caches[0][0].dtype == torch.bfloat16 else (lambda t: t)
    h = r(h[None].float())
    for layer, (kc, vc) in zip(layers, kv_caches, strict=True):
        x = r(rms_norm_ref(h, layer.in_norm, shape.eps))
        q, k, v = r(layer.qkv.ref(x)).split([nh * hd, nkv * hd, nkv * hd], -1)
        if layer.qk_norm == "full":
            q, k = r(rms_norm_ref(q, layer.q_norm, shape.eps)), r(rms_norm_ref(k, layer.k_norm, shape.eps))
        elif layer.qk_norm == "head":
            q = r(rms_norm_ref(q.reshape(nh, hd), layer.q_norm, shape.eps)).reshape(1, -1)
            k = r(rms_norm_ref(k.reshape(nkv, hd), layer.k_norm, shape.eps)).reshape(1, -1)
        if layer.clip is not None:
            q, k, v = (t.clamp(-layer.clip, layer.clip) for t in (q, k, v))
        q, k = (r(t) for t in apply_rotary_ref(q.view(1, nh, hd), k.view(1, nkv, hd), cos, sin))
        kc.view(-1, nkv, hd)[slot], vc.view(-1, nkv, hd)[slot] = k[0], v.view(nkv, hd)
        o = r(paged_attention_decode_ref(q, kc, vc, table[None], torch.tensor([seq_len], dtype=torch.int32),
                                         hd**-0.5 if scale is None else scale))
        o = r(layer.o.ref(o.flatten(1)))
        h = r(h + (o if layer.o_scale == 1.0 else r(o * layer.o_scale)))
        x = r(rms_norm_ref(h, layer.post_norm, shape.eps))
        if layer.experts is not None:
            h = r(h + layer.experts.ref(x))
        else:
            h = r(h + r(layer.down.ref(silu_and_mul_ref(r(layer.gate_up.ref(x))))))
    return rms_norm_ref(h, final_norm, shape.eps)[0], h[0]


def cpu_kernel_available() -> bool:
    return library(_SOURCE).get() is not None


def bf16_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the build takes bf16 models and weights (AVX512-BF16)."""
    lib = lib or library(_SOURCE).get()
    return lib is not None and bool(lib.decode_stack_bf16())


class DecodeStack:
    """The C step over fixed weights: the structs point into the given tensors (kept here alive
    and never moved), the scratch grows with the context. The caches' addresses are taken again
    only when the list holds other entries (identity): a cache tensor must not move either. One
    instance per model; not thread-safe."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor, shape: StackShape, *,
                 embed: torch.Tensor | None = None, lib: ctypes.CDLL | None = None, scale: float | None = None,
                 emb_scale: float = 1.0, dtype: torch.dtype = torch.float32) -> None:
        """embed: the [vocab, hidden] token embedding (of `dtype`) step_ids looks tokens up in (its
        rows times emb_scale). scale: the softmax scale (default head_dim ** -0.5). dtype: the
        model's, float32 or bf16 (its caches and embedding; module docstring). lib: a build of
        csrc/decode_stack_cpu.c (tests pass cpu_build.build_variant's); default the cached one."""
        lib = lib or library(_SOURCE).get()
        if lib is None:
            raise RuntimeError("decode_stack_cpu.c could not be built")
        self._fn, self._scratch_fn, self._ids_fn = lib.decode_stack_f32, lib.decode_stack_scratch, lib.decode_stack_ids
        self._fn.argtypes = [PTR, PTR, PTR, I64, I64, I64, PTR, PTR, PTR, PTR, I64]
        self._fn.restype = ctypes.c_int
        self._ids_fn.argtypes = [PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR, I64]
        self._ids_fn.restype = ctypes.c_int
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.dtype = dtype
        if embed is not None:
            assert embed.dtype == dtype and embed.device.type == "cpu" and embed.stride(1) == 1
            assert embed.shape[1] == final_norm.shape[0], embed.shape
        self._embed = embed
        self._scratch_fn.argtypes, self._scratch_fn.restype = [PTR, I64], I64
        hidden = final_norm.shape[0]
        inter = max((ly.down.in_features for ly in layers if ly.down is not None), default=0)
        moes = [ly.experts for ly in layers if ly.experts is not None]
        self.shape, self.hidden = shape, hidden
        self._keep = (layers, final_norm.float().contiguous())
        self._cos, self._sin = rotary_cos_sin(torch.arange(shape.max_positions), shape.head_dim, shape.rope_theta)
        self._layers = (_Layer * len(layers))(*[ly.struct() for ly in layers])
        for ly in layers:
            assert ly.in_norm.dtype == ly.post_norm.dtype == torch.float32 and ly.in_norm.is_contiguous()
        self._model = _Model(len(layers), hidden, inter, shape.num_heads, shape.num_kv_heads, shape.head_dim, 0,
                             shape.max_positions, shape.eps, shape.head_dim**-0.5 if scale is None else scale,
                             self._keep[1].data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(),
                             ctypes.cast(self._layers, ctypes.POINTER(_Layer)), emb_scale,
                             max((x.router.shape[0] for x in moes), default=0),
                             max((x.top_k for x in moes), default=0), max((x.inter for x in moes), default=0),
                             int(dtype == torch.bfloat16))
        self._model_ref = ctypes.byref(self._model)
        self._scratch = torch.empty(0)
        self._h = torch.empty(hidden)  # step_ids' residual stream
        self._k_ptrs, self._v_ptrs = (ctypes.c_void_p * len(layers))(), (ctypes.c_void_p * len(layers))()
        self._kv_seen: list = []  # the cache list entries the pointers were taken from

    def _prepare(self, seq_len: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Scratch for seq_len positions and the caches' addresses (looked up again only for new entries)."""
        self._model.block_size = kv_caches[0][0].shape[1]
        need = self._scratch_fn(self._model_ref, seq_len)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()))
        if len(kv_caches) != len(self._kv_seen) or any(map(operator.is_not, kv_caches, self._kv_seen)):
            for i, (kc, vc) in enumerate(kv_caches):
                self._k_ptrs[i], self._v_ptrs[i] = kc.data_ptr(), vc.data_ptr()
            self._kv_seen = list(kv_caches)

    def step_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, seq_len: int,
                 table: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """step for the token input_ids[0] at positions[0], cache slot slot_mapping[0] (int64 CPU
        tensors, read by the C call), its embedding row from `embed`: final_norm(h') [hidden]. None
        when the C call refuses (a token outside the vocabulary included)."""
        emb = self._embed
        assert emb is not None, "DecodeStack(embed=...) looks the tokens up"
        self._prepare(seq_len, kv_caches)
        out = torch.empty(self.hidden)
        status = self._ids_fn(self._model_ref, emb.data_ptr(), emb.stride(0), emb.shape[0], input_ids.data_ptr(),
                              positions.data_ptr(), slot_mapping.data_ptr(), self._h.data_ptr(), out.data_ptr(),
                              seq_len, table.data_ptr(), self._k_ptrs, self._v_ptrs, self._scratch.data_ptr(),
                              self._scratch.numel())
        return out if status == 0 else None

    def step(self, h: torch.Tensor, pos: int, slot: int, seq_len: int, table: torch.Tensor,
             kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """final_norm(h') [hidden] for this token's embedding h (float32 [hidden], contiguous: updated
        in place to the residual stream h'); table: the sequence's int32 block table, contiguous.
        Caches as the module docstring, checked by the caller. None when the C call refuses."""
        self._prepare(seq_len, kv_caches)
        out = torch.empty(self.hidden)
        status = self._fn(self._model_ref, h.data_ptr(), out.data_ptr(), pos, slot, seq_len, table.data_ptr(),
                          self._k_ptrs, self._v_ptrs, self._scratch.data_ptr(), self._scratch.numel())
        return out if status == 0 else None
