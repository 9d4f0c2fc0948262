"""Attention of DeepSeek-V4's compressed layers: one softmax over the sliding window of the shared
K=V head, the layer's compressed entries the query may use, and the per-head sink.

Every query row gathers its own keys straight from the paged planes: the `window` slots ending at
its position from the K plane, and `extra` rows of the entries plane (HCA: every closed window;
CSA: the indexer's top-k). Values are the keys (shared K=V). Math in float32, like the sink path
of engine.attention. Rows are independent, so decode, chunked prefill and mixed steps are the same
code; in deterministic mode each row is computed alone, so its bits never depend on the batch.
"""
from __future__ import annotations

import torch

from moebus.engine.attention import AttentionMetadata

_CHUNK_ELEMS = 1 << 24  # gathered keys per chunk of rows


def window_slots(meta: AttentionMetadata, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, window] K-plane slots, [T, window] valid) of the keys each row's window covers."""
    dev, bs = positions.device, meta.block_size
    qsl = meta.query_start_loc
    lens = torch.tensor([qsl[b + 1] - qsl[b] for b in range(meta.num_seqs)], device=dev)
    tables = meta.block_tables.long()[torch.repeat_interleave(torch.arange(meta.num_seqs, device=dev), lens)]
    kpos = positions[:, None] + torch.arange(1 - window, 1, device=dev)
    valid = kpos >= 0
    kpos = kpos.clamp(min=0)
    return tables.gather(1, kpos // bs) * bs + kpos % bs, valid


def attend_window_and_entries(q: torch.Tensor, k_cache: torch.Tensor, entries: torch.Tensor,
                              slots: torch.Tensor, slot_valid: torch.Tensor, extra: torch.Tensor,
                              extra_valid: torch.Tensor, scale: float, sinks: torch.Tensor,
                              batch_invariant: bool = False) -> torch.Tensor:
    """q [T, H, D]; k_cache [num_blocks, bs, 1, D]; entries [num_blocks, rows, D]; slots/slot_valid
    [T, W]; extra/extra_valid [T, X] entries rows, each row's valid ones first. Returns [T, H, D] in
    q's dtype."""
    t, h, d = q.shape
    flat_k, flat_e = k_cache.view(-1, d), entries.view(-1, d)
    keys_per_row = slots.shape[1] + extra.shape[1]
    chunk = 1 if batch_invariant else max(1, _CHUNK_ELEMS // max(1, keys_per_row * d))
    valid = torch.cat([slot_valid, extra_valid], dim=1)
    sink = sinks.float().view(1, h, 1)
    out = q.new_empty(t, h, d)
    n_extra = extra_valid.sum(dim=1).tolist() if batch_invariant else None
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        ex, ok = extra[c0:c1], valid[c0:c1]
        if n_extra is not None:  # one row: only its own entries (the valid ones lead), never the batch's padding
            ex, ok = ex[:, :n_extra[c0]], ok[:, :slots.shape[1] + n_extra[c0]]
        keys = torch.cat([flat_k[slots[c0:c1]], flat_e[ex]], dim=1).float()  # [c, K, D]
        scores = torch.einsum("chd,ckd->chk", q[c0:c1].float(), keys) * scale
        scores.masked_fill_(~ok[:, None, :], float("-inf"))
        probs = torch.cat([scores, sink.expand(c1 - c0, -1, -1)], dim=-1).softmax(dim=-1)[..., :-1]
        out[c0:c1] = torch.einsum("chk,ckd->chd", probs, keys).to(out.dtype)
    return out
