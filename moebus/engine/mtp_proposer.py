"""DeepSeek-V4 MTP drafting: the checkpoint's nextn layer as a DraftModelProposer.

State: none of its own across steps. The nextn layer attends only a sliding window, so each
`propose` recomputes it over the last `sliding_window` positions from the target's streams there
(TargetStreams keeps them) into a scratch paged cache, then chains k-1 one-row decode steps on
that cache. Recompute costs one layer over <= window rows per request per step (the target runs
all its layers over 1+k rows), and needs no KV bookkeeping for rejected drafts, preemption,
prefix hits or KV transfer: the window is rebuilt from verified rows every time.

Chaining as DeepSeek does with one nextn layer: draft i+1 feeds the layer's own output streams
for draft i (in place of the target's, not computed yet) and the embedding of draft i, at the
next position. Only the first nextn layer is used (V4 ships one). Drafts are the nextn logits'
argmax: a deterministic draft, so the verifier's one-hot q is its exact distribution and
rejection sampling stays exact at any temperature.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moebus.engine.attention import AttentionMetadata, KVCacheSpec
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Step
from moebus.engine.models.deepseek_v4_mtp import DeepseekV4MTPLayer, load_mtp_layers
from moebus.engine.target_streams import TargetStreams


class MTPProposer:
    def __init__(self, model: DeepseekV4ForCausalLM, layer: DeepseekV4MTPLayer, block_size: int = 16,
                 greedy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """greedy: hidden rows -> token ids by the target's LM head, bound once (the runner's
        LMHead.greedy); default: the argmax of model.compute_logits."""
        self.model, self.layer, self.block_size = model, layer, block_size
        self.greedy = greedy or (lambda h: model.compute_logits(h).argmax(dim=-1))
        c = layer.config
        self.window = c.sliding_window
        self._spec = KVCacheSpec(1, c.head_dim, c.head_dim, sliding_window=c.sliding_window)
        self._cache: tuple[torch.Tensor, ...] | None = None
        self._blocks_per_req = 0

    def _scratch(self, num_reqs: int, k: int) -> tuple[torch.Tensor, ...]:
        per_req = -(-(self.window + k) // self.block_size)
        have = 0 if self._cache is None else self._cache[0].shape[0]
        if self._cache is None or per_req != self._blocks_per_req or have < num_reqs * per_req:
            p = next(self.layer.parameters())
            self._cache = allocate_kv_caches([self._spec], num_reqs * per_req, self.block_size, p.dtype,
                                             p.device)[0]
            self._blocks_per_req = per_req
        return self._cache

    def _meta(self, starts: list[int], counts: list[int], device: torch.device) -> AttentionMetadata:
        """Rows [starts[b], starts[b] + counts[b]) of request b's scratch context (blocks b*nb...)."""
        nb, bs = self._blocks_per_req, self.block_size
        qsl, slots, lens = [0], [], []
        for b, (s, n) in enumerate(zip(starts, counts, strict=True)):
            slots += [(b * nb + i // bs) * bs + i % bs for i in range(s, s + n)]
            qsl.append(qsl[-1] + n)
            lens.append(s + n)
        tables = torch.arange(len(counts) * nb, dtype=torch.int32, device=device).view(len(counts), nb)
        return AttentionMetadata(qsl, lens, torch.tensor(slots, dtype=torch.long, device=device), tables,
                                 torch.tensor(lens, dtype=torch.int32, device=device), bs)

    def _run(self, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        c = self.layer.config
        embeds = self.model.embed_tokens(ids)
        step = V4Step(meta, positions, [self.model.main_rope.cos_sin(positions, c.rope_dim, embeds.dtype)], {})
        return self.layer(streams, embeds, ids, step, cache)

    def _draft(self, out: torch.Tensor) -> torch.Tensor:
        return self.greedy(self.layer.head(out))

    @torch.inference_mode()
    def propose(self, batch_token_ids: Sequence[Sequence[int]], hidden_states: torch.Tensor | None,
                k: int) -> list[list[int]]:
        """hidden_states: TargetStreams.windows(...) for these requests, [B, window, hc, H]."""
        drafts: list[list[int]] = [[] for _ in batch_token_ids]
        if hidden_states is None or k < 1:
            return drafts
        known = (~torch.isnan(hidden_states[:, :, 0, 0])).sum(dim=1).tolist()
        active = [b for b, n in enumerate(known) if n and len(batch_token_ids[b]) >= 2]
        if not active:
            return drafts
        dev, w = hidden_states.device, hidden_states.shape[1]
        cache = self._scratch(len(active), k)
        counts = [known[b] for b in active]
        # row r of request b: position L-1-n+r, the target's streams there and the token after it
        streams = torch.cat([hidden_states[b, w - n:] for b, n in zip(active, counts, strict=True)])
        ids = [t for b, n in zip(active, counts, strict=True) for t in batch_token_ids[b][-n:]]
        pos = [p for b, n in zip(active, counts, strict=True)
               for p in range(len(batch_token_ids[b]) - 1 - n, len(batch_token_ids[b]) - 1)]
        meta = self._meta([0] * len(active), counts, dev)
        out = self._run(streams, torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, cache)
        last = torch.tensor(meta.query_start_loc[1:], device=dev) - 1
        h, tok = out[last], self._draft(out[last])
        chosen = [tok.tolist()]
        next_pos = torch.tensor([len(batch_token_ids[b]) - 1 for b in active], device=dev)
        for i in range(1, k):
            meta = self._meta([n + i - 1 for n in counts], [1] * len(active), dev)
            h = self._run(h, tok, next_pos + i - 1, meta, cache)
            tok = self._draft(h)
            chosen.append(tok.tolist())
        for j, b in enumerate(active):
            drafts[b] = [step[j] for step in chosen]
        return drafts


def build_mtp(model: torch.nn.Module, hf_config: dict, block_size: int,
              greedy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[MTPProposer, TargetStreams]:
    """The proposer over a DeepSeek-V4 checkpoint's first nextn layer, and the tap feeding it the
    target's mHC streams (the input of `hc_head`); greedy: as MTPProposer's."""
    if not isinstance(model, DeepseekV4ForCausalLM):
        raise ValueError("speculative_method='mtp' needs a DeepSeek-V4 checkpoint with nextn layers")
    layer = load_mtp_layers(model, hf_config)[0]
    return MTPProposer(model, layer, block_size, greedy), TargetStreams(model.hc_head, layer.config.sliding_window)
