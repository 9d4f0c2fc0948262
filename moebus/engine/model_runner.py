"""Turns a SchedulerOutput into one flattened forward pass and samples the positions that need it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moebus import platforms
from moebus.engine.attention import AttentionMetadata, KVCacheSpec
from moebus.engine.batch_invariant import make_batch_invariant, tiled
from moebus.engine.isolation import isolate
from moebus.engine.lm_head import LMHead
from moebus.engine.multimodal import ImageSpan, MMEmbeds, step_embeds
from moebus.engine.request import Request
from moebus.engine.sampling.batch import takes_raw_argmax
from moebus.engine.sampling.sampler import Sampler, SamplingBatch
from moebus.engine.sampling.spec_decode import rejection_sample
from moebus.engine.scheduler import SchedulerOutput
from moebus.kernels.argmax import row_argmax
from moebus.kv.groups import KVLayout, allocate_caches

PLACEHOLDER = -1  # an output token whose value the previous (still running) step will produce


@dataclass(slots=True)
class StepResult:
    """Per scheduled request (same order): sampled tokens (empty for a partial prefill chunk)."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    num_accepted_drafts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ModelInput:
    """One step's batch, built on the host before launch."""

    sched: SchedulerOutput
    token_ids: list[int]
    pending: list[tuple[int, str]]
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # flattened token index whose logits we need
    sample_owner: list[int]  # scheduled entry each sampled row belongs to
    grammar_masks: torch.Tensor | None
    outputs: list[list[int]]  # output tokens of each sampling request, at launch
    drafts: list[list[int]]  # draft tokens of each sampling request, at launch
    mm_embeds: MMEmbeds | None = None  # image rows of this step's prefill chunks


def allocate_kv_caches(specs: list[KVCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (k, v, *planes), every tensor indexed by block id first (one KV group)."""
    return allocate_caches(specs, KVLayout.plan(specs, bounded=False), (num_blocks, 0), block_size, dtype, device)


def kv_bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    return KVLayout.plan(specs, bounded=False).bytes_per_block(specs, block_size, dtype)[0]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, eos_token_ids: list[int],
                 batch_invariant: bool = False, windowed: bool = False) -> None:
        """windowed: the caches have a windowed KV group (kv.groups), indexed by each
        request's window_block_ids."""
        self.windowed = windowed
        self.model = make_batch_invariant(model) if batch_invariant else model
        self.platform = platforms.current(device)
        self.platform.prepare_model(self.model, batch_invariant)  # CPU: prepacked oneDNN GEMMs
        self.eos_token_ids = eos_token_ids
        self.batch_invariant = batch_invariant
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.last_sampled: dict[str, int] = {}  # request id -> token sampled by the latest step
        # Steps whose rows all decode greedily on raw logits skip the sampler (raw_argmax); with a
        # greedy head (hidden rows -> token ids) their tokens come from a fused head+argmax kernel,
        # no [rows, vocab] logits. Where the platform says (the CPU: measured there; GPUs keep the
        # sampler path) and not in deterministic mode (its logits are tiled).
        self.raw_argmax = self.platform.raw_argmax and not batch_invariant
        self.head = LMHead.of(self.model)  # float32 logits on every path (engine/lm_head.py)
        self.greedy_head = self.head.greedy if self.raw_argmax else None

    def _token(self, req: Request, i: int) -> int:
        return req.draft_token_ids[i - req.num_tokens] if i >= req.num_tokens else req.token_at(i)

    def prepare(self, sched: SchedulerOutput, grammar_masks: torch.Tensor | None = None) -> ModelInput:
        """Host-side batch building, on the scheduling thread: it snapshots everything the scheduler
        may change while the step runs (block tables, token lists)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_owner: list[int] = []
        pending: list[tuple[int, str]] = []  # (flat index, request id) of tokens the previous step produces
        image_chunks: list[tuple[int, int, int, list[ImageSpan]]] = []
        bs = self.block_size
        for j, s in enumerate(sched.scheduled):
            r = s.request
            if r.images and s.start < r.images[-1].end:
                image_chunks.append((len(ids), s.start, s.num_tokens, r.images))
            for p in range(s.start, s.start + s.num_tokens):
                tid = self._token(r, p)
                if tid == PLACEHOLDER:
                    pending.append((len(ids), r.request_id))
                ids.append(tid)
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            qsl.append(len(ids))
            seq_lens.append(s.start + s.num_tokens)
            if s.sample:  # reaches the end of the known tokens: sample (1 + drafts) positions
                sample_rows.extend(range(qsl[-1] - 1 - s.num_draft, qsl[-1]))
                sample_owner.extend([j] * (1 + s.num_draft))
        max_blocks = max(len(s.request.block_ids) for s in sched.scheduled)
        tables = torch.tensor([s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids))
                               for s in sched.scheduled], dtype=torch.int32)  # one call, not one per row
        dev = self.device
        meta = AttentionMetadata(qsl, seq_lens, torch.tensor(slots, dtype=torch.long, device=dev),
                                 tables.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev), bs,
                                 batch_invariant=self.batch_invariant)
        if self.windowed:
            meta.window = self._window_meta(sched, meta)
        sampled = sorted(set(sample_owner))
        return ModelInput(sched, ids, pending, torch.tensor(pos, device=dev), meta, sample_rows, sample_owner,
                          grammar_masks, [list(sched.scheduled[j].request.output_token_ids) for j in sampled],
                          [list(sched.scheduled[j].request.draft_token_ids) for j in sampled],
                          step_embeds(image_chunks, dev) if image_chunks else None)

    def _window_meta(self, sched: SchedulerOutput, meta: AttentionMetadata) -> AttentionMetadata:
        """The windowed group's slots and tables; a block the window has passed (-1) reads as block 0,
        which no query's window includes."""
        bs, slots = self.block_size, []
        for s in sched.scheduled:
            ids = s.request.window_block_ids
            slots.extend(ids[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_tokens))
        width = meta.block_tables.shape[1]
        tables = torch.tensor([s.request.window_block_ids + [0] * (width - len(s.request.window_block_ids))
                               for s in sched.scheduled], dtype=torch.int32).clamp_(min=0)
        dev = self.device
        return AttentionMetadata(meta.query_start_loc, meta.seq_lens, torch.tensor(slots, dtype=torch.long, device=dev),
                                 tables.to(dev), meta.seq_lens_t, meta.block_size, meta.batch_invariant)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> StepResult:
        sched, dev = inp.sched, self.device
        ids = list(inp.token_ids)
        for k, rid in inp.pending:
            # A request finished (and forgotten) while this step was queued reads 0: its output is dropped.
            ids[k] = self.last_sampled.get(rid, 0)
        extra = {} if inp.mm_embeds is None else {"mm_embeds": inp.mm_embeds}
        hidden = self.model(torch.tensor(ids, device=dev), inp.positions, inp.meta, self.kv_caches, **extra)
        n = len(sched.scheduled)
        result = StepResult([[] for _ in range(n)], [None] * n, [0] * n)
        if not inp.sample_rows:
            return result
        # sample rows are distinct and ascending: as many as the hidden rows (a decode step) is all of them
        rows = (hidden if len(inp.sample_rows) == hidden.shape[0]
                else hidden[torch.tensor(inp.sample_rows, device=dev)])
        entries = sorted(set(inp.sample_owner))
        if self.raw_argmax and self._raw_greedy(inp, entries):
            # without a greedy head: the sampler's own argmax of the logits, without building a
            # SamplingBatch (a visible share of a batch-1 step's Python)
            tokens = (self.greedy_head(rows) if self.greedy_head is not None
                      else row_argmax(self.head.logits(rows))).tolist()
            for k, j in enumerate(entries):
                result.tokens[j] = [tokens[k]]
        else:
            logits = tiled(self.head.logits, rows) if self.batch_invariant else self.head.logits(rows)
            ids = [sched.scheduled[j].request.request_id for j in entries]
            isolate("sampling", ids, lambda: self._sample(inp, logits, result),
                    lambda k: self._probe_sample(inp, logits, entries, k))
        for j, toks in enumerate(result.tokens):
            if toks:
                self.last_sampled[sched.scheduled[j].request.request_id] = toks[-1]
        return result

    def _raw_greedy(self, inp: ModelInput, entries: list[int]) -> bool:
        """Every sampled row (entries: the sampling requests' indices) takes the argmax of its raw
        logits: one row per request (no drafts), greedy, and no penalties, bans, grammar masks or
        logprobs (see takes_raw_argmax)."""
        if len(entries) != len(inp.sample_owner):
            return False
        # outputs as _known_outputs sees them: a trailing placeholder is the token being sampled
        lens = [len(o) - (bool(o) and o[-1] == PLACEHOLDER) for o in inp.outputs]
        return takes_raw_argmax([inp.sched.scheduled[j].request.params for j in entries], lens,
                                self.eos_token_ids, inp.grammar_masks is not None)

    def _sample(self, inp: ModelInput, logits: torch.Tensor, result: StepResult) -> None:
        sched, owner, grammar_masks = inp.sched, inp.sample_owner, inp.grammar_masks
        entries = sorted(set(owner))
        reqs = [sched.scheduled[j].request for j in entries]
        outs = [self._known_outputs(r.request_id, o) for r, o in zip(reqs, inp.outputs, strict=True)]
        batch = SamplingBatch.build([r.params for r in reqs], outs, [r.prompt_token_ids for r in reqs],
                                    [r.generator for r in reqs], logits.shape[-1], logits.device,
                                    allowed_token_mask=grammar_masks, eos_token_id=self.eos_token_ids)
        if len(owner) == len(entries):  # no drafts in this step: one row per request
            out = self.sampler(logits, batch)
            tokens = out.sampled_token_ids.tolist()
            for k, j in enumerate(entries):
                result.tokens[j] = [tokens[k]]
                n_lp = reqs[k].params.logprobs
                if out.logprobs is not None and n_lp is not None:
                    lp, _rank, top = out.logprobs.row(k, n_lp)
                    result.logprobs[j] = [{tokens[k]: lp, **dict(top)}]
            return
        k_max = max(sched.scheduled[j].num_draft for j in entries)
        target = logits.new_full((len(entries), k_max + 1, logits.shape[-1]), float("-inf"))
        drafts = torch.zeros(len(entries), k_max, dtype=torch.long)
        row = 0
        for k, j in enumerate(entries):
            nd = sched.scheduled[j].num_draft
            target[k, : nd + 1] = logits[row: row + nd + 1]
            drafts[k, :nd] = torch.tensor(inp.drafts[k][:nd], dtype=torch.long)
            row += nd + 1
        accepted = rejection_sample(target, drafts, [sched.scheduled[j].num_draft for j in entries], batch)
        for k, j in enumerate(entries):
            result.tokens[j] = list(accepted[k])
            result.num_accepted_drafts[j] = len(accepted[k]) - 1

    def _probe_sample(self, inp: ModelInput, logits: torch.Tensor, entries: list[int], k: int) -> None:
        """Sample the k-th sampling request alone (its last row, no drafts): raises if its own
        parameters or state do. Its generator is left as it was."""
        sched = inp.sched
        row = sum(sched.scheduled[j].num_draft + 1 for j in entries[: k + 1]) - 1
        r = sched.scheduled[entries[k]].request
        masks = inp.grammar_masks
        mask = masks[k : k + 1] if masks is not None and masks.dim() == 2 else None
        state = r.generator.get_state() if r.generator is not None else None
        try:
            batch = SamplingBatch.build([r.params], [self._known_outputs(r.request_id, inp.outputs[k])],
                                        [r.prompt_token_ids], [r.generator], logits.shape[-1], logits.device,
                                        allowed_token_mask=mask, eos_token_id=self.eos_token_ids)
            self.sampler(logits[row : row + 1], batch)
        finally:
            if state is not None:
                r.generator.set_state(state)

    def _known_outputs(self, request_id: str, out: list[int]) -> list[int]:
        """Output tokens as penalties see them: the trailing placeholder is the token being sampled now;
        an earlier one (async scheduling) is the previous step's sample."""
        if out and out[-1] == PLACEHOLDER:
            out = out[:-1]
        return [self.last_sampled.get(request_id, 0) if t == PLACEHOLDER else t for t in out]

    def set_last_sampled(self, request_id: str, token: int) -> None:
        """A token sampled elsewhere (a prefill engine's first token), as if this runner had."""
        self.last_sampled[request_id] = token

    def forget(self, request_id: str) -> None:
        self.last_sampled.pop(request_id, None)
