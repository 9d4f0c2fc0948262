"""DeepSeek-V4 KV compressor and lightning indexer on the paged cache (reference: HF DeepseekV4
{HCA,CSA}Compressor, DeepseekV4Indexer).

A compressed layer pools every `rate` tokens into one entry. Entry w of HCA pools tokens
[w*r, (w+1)*r); entry w of CSA ("overlap") pools the first half-channels (Ca) of tokens
[(w-1)*r, w*r) together with the second half (Cb) of [w*r, (w+1)*r). Each entry is RMS-normed and
rotated at position w*r with the compress rope. The CSA indexer runs its own, narrower overlap
compressor whose entries are its keys.

Paged state, all in the request's blocks (so chunked prefill, prefix-cache hits and recompute
after preemption need nothing else):
- `src` plane, one row per token: the token's projected `kv | gate`. This is the pending buffer
  (tokens of the window not yet closed) and the overlap state (the previous window's Ca).
- `entries` plane, one row per `rate` tokens: entry w lives in the block of its closing token
  (w+1)*r - 1, row ((w+1)*r - 1) % block_size // r, so a full block's entries depend only on
  tokens up to that block's end: a shared prefix block is never written by a later request.
An entry is written by the step that computes its closing token, from `src` rows of this step and
earlier ones.

Channels are in our rope layout (see deepseek_v4_attention.hf_channel_perm): the pooling and the
norm are per channel / permutation invariant, so permuting the loaded weights is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moebus.engine.attention import AttentionMetadata
from moebus.engine.models.deepseek_v4_attention import RMSNorm
from moebus.kernels import apply_rotary
from moebus.kernels.compressor import compress_windows
from moebus.kernels.indexer_topk import indexer_topk


@dataclass(slots=True)
class CompressPlan:
    """Where one step's compression of one (rate, overlap) kind reads and writes, for all layers of
    that kind. Rows are flat indices into `[num_blocks * rows_per_block]` views of the planes."""

    rate: int
    src_slots: torch.Tensor  # [W, L] token slots of each window closing this step (L = 2r with overlap)
    first: torch.Tensor  # [W] bool: window 0 (its overlap half has no tokens)
    positions: torch.Tensor  # [W] w * rate, the entry's rope position
    dst: torch.Tensor  # [W] entries row the window's entry goes to
    entry_rows: torch.Tensor  # [E] entries row of every complete entry of every sequence, by sequence
    row_start: torch.Tensor  # [T] offset of each query row's sequence in entry_rows
    row_visible: torch.Tensor  # [T] entries a query sees: (position + 1) // rate
    cos: torch.Tensor | None = None  # [W, rope_dim/2] compress rope at `positions` (set by the model)
    sin: torch.Tensor | None = None
    window: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's window_slots (set by the model)


def build_plan(meta: AttentionMetadata, positions: torch.Tensor, rate: int, overlap: bool) -> CompressPlan:
    bs, dev = meta.block_size, positions.device
    rpb = max(1, bs // rate)
    tables = meta.block_tables.long()
    qsl = meta.query_start_loc
    seq_lens = torch.tensor(meta.seq_lens, device=dev)
    n_new = torch.tensor([qsl[b + 1] - qsl[b] for b in range(meta.num_seqs)], device=dev)
    seqs = torch.arange(meta.num_seqs, device=dev)

    def expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner sequence, index within its sequence, first flat index of each sequence) of a ragged range."""
        first = torch.cumsum(counts, 0) - counts
        owner = torch.repeat_interleave(seqs, counts)
        return owner, torch.arange(owner.numel(), device=dev) - first[owner], first

    # every complete entry of every sequence, by sequence: entry e lives in its closing token's block
    e_seq, e, e_first = expand(seq_lens // rate)
    close = (e + 1) * rate - 1
    entry_rows = tables[e_seq, close // bs] * rpb + (close % bs) // rate
    # windows closed by this step's tokens: w in [(seq_len - n_new) // r, seq_len // r)
    w_lo = (seq_lens - n_new) // rate
    w_seq, w_i, _ = expand(seq_lens // rate - w_lo)
    w = w_lo[w_seq] + w_i
    span = 2 * rate if overlap else rate
    tok = (w[:, None] * rate + torch.arange(span, device=dev) - (rate if overlap else 0)).clamp(min=0)
    src_tables = meta.windowed().block_tables.long()  # per-token rows: a windowed part (kv.groups)
    src_slots = src_tables[w_seq[:, None], tok // bs] * bs + tok % bs
    return CompressPlan(rate, src_slots, w == 0, w * rate, entry_rows[e_first[w_seq] + w], entry_rows,
                        torch.repeat_interleave(e_first, n_new), (positions + 1) // rate)


class Compressor(nn.Module):
    """Pools `rate` tokens into one `head_dim` entry (HF's kv_proj / gate_proj / position_bias /
    kv_norm). With `overlap`, the projections are 2*head_dim wide: [Ca | Cb]. A CSA layer's
    compressor carries its `indexer` (HF's module path: compressor.indexer)."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float,
                 indexer: Indexer | None = None):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)
        self.indexer = indexer

    @property
    def src_dim(self) -> int:
        return 2 * self.kv_proj.out_features

    def hf_to_local(self, name: str, tensor: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """`name` relative to this module; `perm` reorders one head_dim chunk of channels."""
        chunks = tensor.shape[-1 if name == "position_bias" else 0] // self.head_dim
        full = torch.cat([perm + i * self.head_dim for i in range(chunks)])
        return tensor[:, full] if name == "position_bias" else tensor[full]

    def write(self, x: torch.Tensor, slot_mapping: torch.Tensor, src_cache: torch.Tensor) -> None:
        """Store this step's tokens' `kv | gate` rows."""
        src = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)
        src_cache.view(-1, self.src_dim).index_copy_(0, slot_mapping, src.to(src_cache.dtype))

    def compress(self, plan: CompressPlan, src_cache: torch.Tensor, entry_cache: torch.Tensor) -> None:
        """Pool the windows that close this step into their entries."""
        if plan.dst.numel() == 0:
            return
        hd, r = self.head_dim, self.rate
        g = src_cache.view(-1, self.src_dim)[plan.src_slots]  # [W, L, 2 * width]
        bias = self.position_bias
        if self.overlap:  # slots [0, r): previous window's Ca; [r, 2r): this window's Cb
            kv = torch.cat([g[:, :r, :hd], g[:, r:, hd:2 * hd]], dim=1)
            gate = torch.cat([g[:, :r, 2 * hd:3 * hd], g[:, r:, 3 * hd:]], dim=1)
            gate[:, :r].masked_fill_(plan.first[:, None, None], float("-inf"))
            bias = torch.cat([bias[:, :hd], bias[:, hd:]], dim=0)
        else:
            kv, gate = g[..., :hd], g[..., hd:]
        entry = self.kv_norm(compress_windows(kv, gate, bias))
        entry = apply_rotary(entry[:, None], entry[:, None], plan.cos, plan.sin)[0][:, 0]
        entry_cache.view(-1, hd).index_copy_(0, plan.dst, entry.to(entry_cache.dtype))


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer: an overlap compressor at `index_head_dim` whose entries are keys, and
    queries from the attention's low-rank q residual; picks the top `topk` entries per query."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rate: int,
                 topk: int, eps: float):
        super().__init__(hidden_size, head_dim, rate, True, eps)
        self.num_heads, self.topk = num_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, num_heads)

    def hf_to_local(self, name: str, tensor: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        if name == "q_b_proj.weight":
            return tensor.view(self.num_heads, self.head_dim, -1)[:, perm].reshape(tensor.shape)
        if name == "scorer.weights_proj.weight":
            return tensor
        return super().hf_to_local(name, tensor, perm)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               plan: CompressPlan, key_cache: torch.Tensor) -> torch.Tensor:
        """[T, topk] entries (indices into each row's sequence's entries) each query attends; -1 = none."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim)
        q = apply_rotary(q, q[:, :1], cos, sin)[0]
        weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5
        keys = key_cache.view(-1, self.head_dim)[plan.entry_rows]
        return indexer_topk(q, weights, keys, plan.row_start, plan.row_visible, self.topk, self.head_dim ** -0.5)
