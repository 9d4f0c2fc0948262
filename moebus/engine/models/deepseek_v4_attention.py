"""DeepSeek-V4 sliding-window attention on the paged backend.

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

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, attend
from moebus.engine.batch_invariant import tiled
from moebus.kernels import apply_rotary, rms_norm


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
                 o_groups: int, o_lora_rank: int, sliding_window: int, eps: float):
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

    def hf_to_local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Reorder head channels of an HF weight (`name` relative to this module) into our layout."""
        hd = self.head_dim
        perm = hf_channel_perm(hd, self.rope_dim, tensor.device)
        if name == "q_b_proj.weight":
            return tensor.reshape(self.num_heads, hd, -1)[:, perm].reshape(tensor.shape)
        if name in ("kv_proj.weight", "kv_norm.weight"):
            return tensor[perm]
        if name == "o_a_proj.weight":
            return tensor.reshape(tensor.shape[0], -1, hd)[:, :, perm].reshape(tensor.shape)
        return tensor

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H]; cos/sin [T, rope_dim/2] at each token's position."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(T, self.num_heads, self.head_dim)
        # the per-head q RMS norm has no weight: with ones it is one rms_norm kernel call, not ~6 ops
        q = rms_norm(q, q.new_ones(self.head_dim), self.eps)
        kv = self.kv_norm(self.kv_proj(x)).view(T, 1, self.head_dim)
        q, kv = apply_rotary(q, kv, cos, sin)
        # Shared K=V: the paged cache keeps separate K and V planes, so the head is stored twice.
        out = attend(q, kv, kv, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                     sinks=self.sinks)
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
