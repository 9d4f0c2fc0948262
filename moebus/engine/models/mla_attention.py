"""Multi-head Latent Attention (DeepSeek-V2/V3) on the paged backend, caching only the latent.

Per token the layer keeps one "KV head" of r + rope channels: the compressed latent c_kv
(`kv_lora_rank` = r, after `kv_a_layernorm`) and the shared roped key k_pe. Attention runs in the
absorbed form: `kv_b_proj` [H * (nope + v), r] holds per head W_UK [nope, r] (the key rows) and
W_UV [v, r] (the value rows), so

    q_h . k_h = (q_nope_h W_UK_h) . c_kv + q_pe_h . k_pe      (query [q_lat | q_pe], key [c_kv | k_pe])
    o_h       = (sum_j p_j c_kv_j) W_UV_h^T                    (value c_kv, then up-projected)

i.e. MQA with H query heads over a single latent head, softmax scale qk_head_dim^-0.5 (times the
YaRN mscale^2 the caller folds in). No per-head key or value is ever materialised.

Cache layout: K = [c_kv | k_pe] per token and V is a strided view of K's first r channels, so the
latent is stored once (the spec's V plane is empty, as DeepSeek-V4's compressed layers). `attend`,
the paged decode kernels (C, Triton, torch) and the CPU prefill kernel all address V through its
strides, so the view is read in place; `attend` also writes V through it, rewriting the same values.

Prefill also runs absorbed (attention over r + rope channels per head instead of nope + rope):
more FLOPs for long prompts than expanding the latent per head, but one path for chunked prefill,
prefix hits and decode, all reading the same latent cache.

RoPE layout: DeepSeek rotates interleaved pairs (2i, 2i+1) of the rope channels (V2 always, V3 with
`rope_interleave`); our kernel is neox style (pairs (i, i + rope/2)). With `interleaved` the rope
rows of the query projection and of `kv_a_proj_with_mqa` are reordered at load time to
[evens | odds] (`hf_to_local`); scores are invariant to a permutation shared by q and k.
"""
from __future__ import annotations

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata, attend
from moebus.engine.batch_invariant import tiled
from moebus.engine.models.llama import RMSNorm
from moebus.kernels.rotary import apply_rotary_


class LatentProjection(nn.Module):
    """HF's `kv_b_proj` weight [H * (nope + v), r], used only in absorbed form (never as a Linear)."""

    batch_invariant: bool = False  # deterministic mode (engine.batch_invariant)

    def __init__(self, num_heads: int, nope: int, v: int, rank: int):
        super().__init__()
        self.nope = nope
        self.weight = nn.Parameter(torch.zeros(num_heads * (nope + v), rank))
        self.num_heads = num_heads

    def _product(self, eq: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:  # fixed row tiles: a token's bits do not depend on the batch
            return tiled(lambda c: torch.einsum(eq, c, w), x)
        return torch.einsum(eq, x, w)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> q_lat [T, H, r] (q_nope_h W_UK_h)."""
        w_uk = self.weight.view(self.num_heads, -1, self.weight.shape[1])[:, :self.nope]
        return self._product("thn,hnr->thr", q_nope, w_uk)

    def expand_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, H, r] -> [T, H * v] (o_lat_h W_UV_h^T)."""
        w_uv = self.weight.view(self.num_heads, -1, self.weight.shape[1])[:, self.nope:]
        return self._product("thr,hvr->thv", o_lat, w_uv).flatten(1)


def interleaved_to_neox(rope: int, device: torch.device | None = None) -> torch.Tensor:
    """perm[j] = the HF rope channel our rope channel j holds: [evens | odds]."""
    idx = torch.arange(rope, device=device)
    return torch.cat([idx[0::2], idx[1::2]])


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, eps: float, scale: float,
                 interleaved: bool):
        super().__init__()
        self.num_heads, self.nope, self.rope, self.rank = num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
        self.scale = scale
        self.interleaved = interleaved
        self.q_lora = q_lora_rank is not None  # V2-Lite projects q directly (q_proj)
        q_dim = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = LatentProjection(num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    @property
    def cache_dim(self) -> int:
        """Channels per token in the cache's K plane (V is a view of its first `rank`)."""
        return self.rank + self.rope

    def hf_to_local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An HF weight (`name` relative to this module) in our rope channel order."""
        if not self.interleaved:
            return tensor
        perm = interleaved_to_neox(self.rope, tensor.device)
        if name in ("q_proj.weight", "q_b_proj.weight"):
            per_head = tensor.reshape(self.num_heads, self.nope + self.rope, -1)
            rope_rows = per_head[:, self.nope:][:, perm]
            return torch.cat([per_head[:, :self.nope], rope_rows], dim=1).reshape(tensor.shape)
        if name == "kv_a_proj_with_mqa.weight":
            return torch.cat([tensor[:self.rank], tensor[self.rank:][perm]])
        return tensor

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, hidden]; cos/sin [T, rope/2] at each token's position (attention factor included)."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(T, self.num_heads, self.nope + self.rope)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :self.rank])
        q_pe, k_pe = apply_rotary_(q[..., self.nope:], kv[:, None, self.rank:], cos, sin)  # in place, no copies
        query = torch.cat([self.kv_b_proj.absorb_query(q[..., :self.nope]), q_pe], dim=-1)
        key = torch.cat([c_kv, k_pe[:, 0]], dim=-1).view(T, 1, self.cache_dim)
        k_cache = kv_cache[0]
        v_view = k_cache[..., :self.rank]  # the latent, stored once (see module docstring)
        out = attend(query, key, key[..., :self.rank], (k_cache, v_view), meta, self.scale)
        return self.o_proj(self.kv_b_proj.expand_output(out))
