"""Paged attention backend: the one place that knows the KV-cache layout.

The batch is flattened ("varlen"): T query tokens from B sequences, sequence b owning tokens
query_start_loc[b]:query_start_loc[b+1]. Every layer's cache is a pair of tensors
`k_cache [num_blocks, block_size, Hkv, Dk]`, `v_cache [num_blocks, block_size, Hkv, Dv]`;
a token at logical position p of sequence b lives in slot block_tables[b, p // bs] * bs + p % bs.
With bounded sliding windows (kv.groups) a sliding layer's k/v live in the windowed pool:
`attend` then reads `meta.windowed()`'s tables and slots instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moebus import platforms
from moebus.kernels import paged_attention_decode
from moebus.kernels.prefill_attention import attend_one_ref, gather_seq


@dataclass(frozen=True, slots=True)
class CachePlane:
    """Extra paged state of a layer beyond K/V: `dim` values per `tokens_per_row` tokens, kept in
    the request's blocks (one row per token, or one per `tokens_per_row` of them, e.g. a KV
    compressor's entries). Allocated as `[num_blocks, rows_per_block(block_size), dim]`."""

    tokens_per_row: int
    dim: int
    # How far back the plane is read: computing token p reads its rows of tokens (p - horizon, p].
    # None = the whole history. A bounded plane may live in the windowed KV group (kv.groups).
    horizon: int | None = None

    def rows_per_block(self, block_size: int) -> int:
        r = self.tokens_per_row
        if block_size % r and r % block_size:
            raise ValueError(f"block_size {block_size} and a cache plane of one row per {r} tokens: "
                             "one must divide the other")
        return max(1, block_size // r)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one attention layer stores per token (and in `planes`, beside it)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    sliding_window: int | None = None  # tokens; None = full attention
    planes: tuple[CachePlane, ...] = ()  # the layer's cache tuple is (k, v, *planes)

    def horizons(self) -> tuple[int | None, ...]:
        """Per part of the cache tuple (k, v, *planes): how far back it is read (None = all of it)."""
        return (self.sliding_window, self.sliding_window, *(p.horizon for p in self.planes))


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: list[int]  # [B+1], python ints: cheap slicing on the host
    seq_lens: list[int]  # [B] context length after this step's tokens are written
    slot_mapping: torch.Tensor  # [T] int64 flat slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens_t: torch.Tensor  # [B] int32, seq_lens on device
    block_size: int
    batch_invariant: bool = False  # deterministic mode: attend per sequence, never batched
    # The windowed KV group's tables and slots (kv.groups), when the engine bounds sliding
    # windows: the parts read within a horizon live in their own block pool. None: one group.
    window: AttentionMetadata | None = None

    def windowed(self) -> AttentionMetadata:
        """The metadata of the windowed parts (sliding K/V, bounded planes): themselves in one group."""
        return self.window or self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def decode_only(self) -> bool:
        return self.query_start_loc[-1] == self.num_seqs


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# Sliding windows up to this many keys take the banded prefill path; each gathered chunk of keys
# (and of values) holds at most _BANDED_CHUNK elements.
BANDED_MAX_WINDOW = 512
_BANDED_CHUNK = 1 << 24


def _prefill_banded(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    seqs: list[int], scale: float, window: int, sinks: torch.Tensor | None,
                    out: torch.Tensor) -> None:
    """Sliding-window attention for every query row of `seqs` at once: each row gathers the window
    of keys and values ending at its own position straight from the paged cache ([rows, W] slots),
    then one batched softmax in float32 (a sink is one more logit with a zero value). O(rows * W),
    and no per-sequence loop: for windows shorter than the prompts this replaces a masked dense
    SDPA call per sequence, which did the masked-out work too (figures: docs/benchmarks/
    history-engine.md, "Banded sliding-window prefill")."""
    k_cache, v_cache = kv_cache
    qsl, bs, dev = meta.query_start_loc, meta.block_size, q.device
    hkv, dk, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    hq = q.shape[1]
    lens = torch.tensor([qsl[b + 1] - qsl[b] for b in seqs], device=dev)
    starts = torch.tensor([qsl[b] for b in seqs], device=dev)
    first_pos = torch.tensor([meta.seq_lens[b] for b in seqs], device=dev) - lens
    rows = torch.cat([torch.arange(qsl[b], qsl[b + 1], device=dev) for b in seqs])
    pos = rows + torch.repeat_interleave(first_pos - starts, lens)
    tables = meta.block_tables.long()[torch.repeat_interleave(torch.tensor(seqs, device=dev), lens)]
    offsets = torch.arange(1 - window, 1, device=dev)
    chunk = max(1, _BANDED_CHUNK // (window * hkv * max(dk, dv)))
    flat_k, flat_v = k_cache.view(-1, hkv, dk), v_cache.view(-1, hkv, dv)
    sink_logits = None if sinks is None else sinks.float().view(1, hkv, hq // hkv, 1)
    for c0 in range(0, rows.numel(), chunk):
        r = rows[c0:c0 + chunk]
        kpos = pos[c0:c0 + chunk, None] + offsets
        valid = kpos >= 0
        kpos = kpos.clamp(min=0)
        slots = tables[c0:c0 + chunk].gather(1, kpos // bs) * bs + kpos % bs
        qg = q[r].float().view(r.numel(), hkv, hq // hkv, dk)
        scores = torch.einsum("ckgd,cwkd->ckgw", qg, flat_k[slots].float()) * scale
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        if sink_logits is not None:
            scores = torch.cat([scores, sink_logits.expand(r.numel(), -1, -1, -1)], dim=-1)
        probs = scores.softmax(dim=-1)[..., :window]
        o = torch.einsum("ckgw,cwkv->ckgv", probs, flat_v[slots].float())
        out[r] = o.reshape(r.numel(), hq, dv).to(out.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
           meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's k/v [T, Hkv, D*] into the cache, then attend q [T, Hq, Dk] causally.

    Returns [T, Hq, Dv]. Earlier context comes from the cache, so chunked prefill, prefix-cache
    hits and decode all go through the same path.
    """
    if sliding_window is not None:
        meta = meta.windowed()
    write_kv(k, v, kv_cache, meta.slot_mapping)
    k_cache, v_cache = kv_cache
    if meta.decode_only and not meta.batch_invariant:
        return paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, scale,
                                      sliding_window=sliding_window, sinks=sinks)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    qsl = meta.query_start_loc
    # The decode rows of a mixed step: one paged-decode call instead of the loop below.
    singles = [] if meta.batch_invariant else [b for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] == 1]
    done: set[int] = set()
    if len(singles) > 1:
        rows = torch.tensor([qsl[b] for b in singles], device=q.device)
        seqs = torch.tensor(singles, device=q.device)
        out[rows] = paged_attention_decode(q[rows], k_cache, v_cache, meta.block_tables[seqs],
                                           meta.seq_lens_t[seqs], scale, sliding_window=sliding_window,
                                           sinks=sinks)
        done = set(singles)
    rest = [b for b in range(meta.num_seqs) if b not in done and qsl[b + 1] > qsl[b]]
    # The platform's one-call kernel for every remaining chunk, where it has one (the CPU's).
    if rest and platforms.of(q).prefill_attention(q, k_cache, v_cache, meta, rest, scale, sliding_window,
                                                 sinks, out) is not None:
        return out
    if sliding_window is not None and sliding_window <= BANDED_MAX_WINDOW and not meta.batch_invariant:
        if rest:
            _prefill_banded(q, kv_cache, meta, rest, scale, sliding_window, sinks, out)
            done.update(rest)
    for b, seq_len in enumerate(meta.seq_lens):
        s, e = qsl[b], qsl[b + 1]
        if s == e or b in done:
            continue
        if seq_len == e - s:  # no earlier context: use this step's k/v directly
            kb, vb = k[s:e], v[s:e]
        else:
            kb = gather_seq(k_cache, meta.block_tables[b], seq_len)
            vb = gather_seq(v_cache, meta.block_tables[b], seq_len)
        out[s:e] = attend_one_ref(q[s:e], kb.to(q.dtype), vb.to(q.dtype), scale, sliding_window, sinks)
    return out
