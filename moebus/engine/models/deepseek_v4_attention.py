"""DeepSeek-V4 attention on the paged backend: sliding-window, and (with a `compressor`) the
compressed kinds, which add compressed entries to the window (deepseek_v4_compressor,
deepseek_v4_sparse_attention).

Per layer: low-rank query (`q_a_proj` -> RMSNorm -> `q_b_proj`, then an unweighted per-head RMS),
one shared K=V head (`kv_proj` -> RMSNorm; the same tensor is the key and the value), partial
RoPE on `rope_dim` channels of each head, a learned per-head attention sink, and a grouped
low-rank output projection (`o_a_proj` block-diagonal over `o_groups` head groups, then
`o_b_proj`). Because V carries RoPE too, the output is rotated back by the query position.

RoPE layout: HF/DeepSeek rotate interleaved channel pairs (2i, 2i+1) of the trailing `rope_dim`
channels of a head. `moebus.kernels.apply_rotary` is neox style on the leading channels (pairs
(i, i + rope_dim/2)). `hf_channel_perm` reorders each head's channels at load time to
[rope evens | rope odds | no-rope], which turns one rotation into the other. Attention scores
are invariant to a permutation shared by q and k, and `o_a_proj`'s input columns are permuted
the same way, so the layer computes exactly the HF function.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, attend
from moebus.engine.batch_invariant import tiled
from moebus.engine.models.deepseek_v4_sparse_attention import attend_window_and_entries, window_slots
from moebus.kernels import apply_rotary, rms_norm

if TYPE_CHECKING:  # the compressor module imports RMSNorm from here
    from moebus.engine.models.deepseek_v4_compressor import Compressor, CompressPlan


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def hf_channel_perm(head_dim: int, rope_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """perm[j] = the HF channel that our channel j holds (see module docstring)."""
    nope = head_dim - rope_dim
    rope = torch.arange(nope, head_dim, device=device)
    return torch.cat([rope[0::2], rope[1::2], torch.arange(nope, device=device)])


class DeepseekV4Attention(nn.Module):
    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, rope_dim: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, sliding_window: int, eps: float,
                 compressor: Compressor | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.o_groups = o_groups
        self.sliding_window = sliding_window
        self.eps = eps
        self.rope_dim = rope_dim
        self.scale = head_dim ** -0.5
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        # Block-diagonal: group g maps its (num_heads/o_groups)*head_dim inputs to o_lora_rank.
        self.o_a_proj = nn.Linear(num_heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        # CSA / HCA: a deepseek_v4_compressor.Compressor (CSA's carries an `indexer`); None = sliding only
        self.compressor = compressor

    def hf_to_local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Reorder head channels of an HF weight (`name` relative to this module) into our layout."""
        hd = self.head_dim
        if name.startswith("compressor.indexer."):
            perm = hf_channel_perm(self.compressor.indexer.head_dim, self.rope_dim, tensor.device)
            return self.compressor.indexer.hf_to_local(name.removeprefix("compressor.indexer."), tensor, perm)
        perm = hf_channel_perm(hd, self.rope_dim, tensor.device)
        if name.startswith("compressor."):
            return self.compressor.hf_to_local(name.removeprefix("compressor."), tensor, perm)
        if name == "q_b_proj.weight":
            return tensor.reshape(self.num_heads, hd, -1)[:, perm].reshape(tensor.shape)
        if name in ("kv_proj.weight", "kv_norm.weight"):
            return tensor[perm]
        if name == "o_a_proj.weight":
            return tensor.reshape(tensor.shape[0], -1, hd)[:, :, perm].reshape(tensor.shape)
        return tensor

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...], positions: torch.Tensor | None = None,
                plan: CompressPlan | None = None) -> torch.Tensor:
        """x [T, H]; cos/sin [T, rope_dim/2] at each token's position (the compress rope in a
        compressed layer); positions [T] and the step's CompressPlan of this layer's kind for those."""
        T = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(T, self.num_heads, self.head_dim)
        # the per-head q RMS norm has no weight: with ones it is one rms_norm kernel call, not ~6 ops
        q = rms_norm(q, q.new_ones(self.head_dim), self.eps)
        kv = self.kv_norm(self.kv_proj(x)).view(T, 1, self.head_dim)
        q, kv = apply_rotary(q, kv, cos, sin)
        if self.compressor is None:
            # Shared K=V: the paged cache keeps separate K and V planes, so the head is stored twice.
            out = attend(q, kv, kv, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                         sinks=self.sinks)
        else:
            out = self._attend_compressed(x, q, kv, q_residual, cos, sin, meta, kv_cache, positions, plan)
        # Undo V's rotation at the query position. kv is already in the cache and unused from
        # here, so it rides along as apply_rotary's k operand.
        out, _ = apply_rotary(out, kv, cos, -sin)
        grouped = out.reshape(T, self.o_groups, -1)
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        if self.batch_invariant:
            low_rank = tiled(lambda c: torch.einsum("tgi,gri->tgr", c, w), grouped).flatten(1)
        else:
            low_rank = torch.einsum("tgi,gri->tgr", grouped, w).flatten(1)
        return self.o_b_proj(low_rank)

    def _attend_compressed(self, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, q_residual: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                           kv_cache: tuple[torch.Tensor, ...], positions: torch.Tensor,
                           plan: CompressPlan) -> torch.Tensor:
        """Cache (k, v (empty: K=V is read from k), src, entries[, indexer src, indexer keys])."""
        k_cache, _, src, entries, *index_planes = kv_cache
        slot_mapping = meta.windowed().slot_mapping  # K and the per-token rows: windowed parts
        k_cache.view(-1, self.head_dim).index_copy_(0, slot_mapping, kv.flatten(1).to(k_cache.dtype))
        comp = self.compressor
        comp.write(x, slot_mapping, src)
        comp.compress(plan, src, entries)  # before attending: a query sees the window it closes
        n_entries = plan.entry_rows.numel()
        if index_planes:
            isrc, ikeys = index_planes
            comp.indexer.write(x, slot_mapping, isrc)
            comp.indexer.compress(plan, isrc, ikeys)
            picks = comp.indexer.select(x, q_residual, cos, sin, plan, ikeys)  # [T, topk], -1 = none
            extra_valid = picks >= 0
            idx = plan.row_start[:, None] + picks.clamp(min=0)
        else:  # HCA: every closed window
            cols = torch.arange(int(plan.row_visible.max()) if n_entries else 0, device=q.device)
            extra_valid = cols[None, :] < plan.row_visible[:, None]
            idx = plan.row_start[:, None] + cols[None, :]
        extra = plan.entry_rows[idx.clamp(max=n_entries - 1)] if n_entries else idx.new_zeros(idx.shape[0], 0)
        if not n_entries:
            extra_valid = extra_valid[:, :0]
        slots, slot_valid = plan.window or window_slots(meta, positions, self.sliding_window)
        return attend_window_and_entries(q, k_cache, entries, slots, slot_valid, extra, extra_valid, self.scale,
                                         self.sinks, self.batch_invariant or meta.batch_invariant)
