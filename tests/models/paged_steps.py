"""Drive a model's forward on the paged backend by hand: sequence b owns blocks
[b*MAX_BLOCKS, (b+1)*MAX_BLOCKS), so parity tests need no scheduler."""
from __future__ import annotations

import itertools

import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.model_runner import allocate_kv_caches

BLOCK = 16
MAX_BLOCKS = 8  # per sequence: 128 tokens


def caches(model: torch.nn.Module, num_seqs: int) -> list[tuple[torch.Tensor, ...]]:
    return allocate_kv_caches(model.kv_cache_specs(), num_seqs * MAX_BLOCKS, BLOCK, torch.float32,
                              torch.device("cpu"))


def step_meta(ctx_lens: list[int], new_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """Sequence b has ctx_lens[b] tokens cached and writes new_lens[b] more this step.
    Returns (metadata, positions)."""
    tables = torch.arange(len(ctx_lens) * MAX_BLOCKS, dtype=torch.int32).view(len(ctx_lens), MAX_BLOCKS)
    pos = [torch.arange(c, c + n) for c, n in zip(ctx_lens, new_lens, strict=True)]
    slots = torch.cat([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(pos)])
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens, strict=True)]
    meta = AttentionMetadata(query_start_loc=[0, *itertools.accumulate(new_lens)], seq_lens=seq_lens,
                             slot_mapping=slots, block_tables=tables,
                             seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32), block_size=BLOCK)
    return meta, torch.cat(pos)


@torch.no_grad()
def run(model, ids: torch.Tensor, ctx_lens: list[int], new_lens: list[int], kv) -> torch.Tensor:
    """float32 logits of one step."""
    meta, positions = step_meta(ctx_lens, new_lens)
    return model.compute_logits(model(ids, positions, meta, kv))


def prompt(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_diff_vs_hf(model, hf_model, ids: torch.Tensor) -> float:
    """Max abs difference of one prefill's logits from HF's forward on the same ids."""
    ours = run(model, ids, [0], [len(ids)], caches(model, 1))
    diff = (ours - hf_model(ids[None]).logits[0].float()).abs().max().item()
    print(f"max abs logit diff vs HF: {diff:.3e}")
    return diff


@torch.no_grad()
def greedy_vs_hf(model, hf_model, ids: torch.Tensor, n_new: int) -> tuple[list[int], list[int]]:
    """(our greedy tokens: one prefill, then decode-only steps; HF generate's) for n_new tokens."""
    ref = hf_model.generate(ids[None], do_sample=False, max_new_tokens=n_new)[0, len(ids):].tolist()
    kv, n = caches(model, 1), len(ids)
    out = [run(model, ids, [0], [n], kv)[-1].argmax().item()]
    for ctx in range(n, n + n_new - 1):
        out.append(run(model, torch.tensor(out[-1:]), [ctx], [1], kv)[-1].argmax().item())
    return out, ref
