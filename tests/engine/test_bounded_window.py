"""Bounded sliding-window KV (engine.kv_groups, engine.window_blocks): a windowed part keeps only the
blocks its window still reads, and every run gives the tokens of the unbounded engine.

Tiny random DeepSeek-V4 checkpoints: all-sliding (a pure sliding-window toy: every part windowed)
and sliding/CSA/HCA (windowed K and compressor rows, full-history compressed entries). Window 16,
block 16, prompts up to 300 tokens: many windows, and many CSA (4) / HCA (32) compression windows.
"""
from __future__ import annotations

import pytest
import torch

from moebus.engine.attention import CachePlane, KVCacheSpec
from moebus.engine.llm import LLM
from moebus.engine.models.hf_checkpoint import write_tiny_deepseek_v4
from moebus.engine.request import Request
from moebus.engine.sampling import SamplingParams
from moebus.engine.window_blocks import WindowedBlockManager
from moebus.kv.groups import FULL, WINDOW, KVLayout, PoolSizing, group_block_ids, pool_sizes

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

MIXED = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
KV_BLOCKS = 96


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_window_blocks_are_freed_and_bounded():
    bm = WindowedBlockManager(64, 16, True, window_blocks=8, horizon=32)
    r = _req("a", 400)
    held = []
    for start in range(0, 400, 16):  # chunked prefill, 16 tokens a step
        r.num_computed_tokens = start
        bm.trim(r)
        assert bm.can_allocate(r, start + 16)
        bm.allocate(r, start + 16)
        held.append(bm.window_blocks_held(r))
        bm.cache_blocks(r)
    assert len(r.block_ids) == 25  # the full group keeps every block
    assert len(r.window_block_ids) == 25 and max(held) == 3  # tokens (p - 32, p]: 3 blocks at most
    assert r.window_block_ids[:22] == [-1] * 22 and min(r.window_block_ids[22:]) >= 0
    assert group_block_ids(r, WINDOW) is r.window_block_ids and group_block_ids(r, FULL) is r.block_ids
    bm.free_request(r)
    assert bm.win.num_free_blocks == 8 and bm.num_free_blocks == 64


def _computed_and_freed(bm: WindowedBlockManager, n: int) -> Request:
    """A request of n tokens, computed, its full blocks published, then freed (cached, unheld)."""
    a = _req("a", n)
    bm.allocate(a, n)
    a.num_computed_tokens = n
    bm.cache_blocks(a)
    bm.free_request(a)
    return a


def test_prefix_hit_needs_the_window_tail():
    bm = WindowedBlockManager(64, 16, True, window_blocks=8, horizon=32)
    a = _computed_and_freed(bm, 100)
    b = _req("b", 100)
    hits = bm.match_prefix(b)  # 6 full blocks; the window of token 96 reads blocks 4 and 5
    assert len(hits) == 6
    bm.allocate(b, 100, hits)
    assert b.window_block_ids[:4] == [-1] * 4 and b.num_computed_tokens == 96
    assert bm.window_blocks_held(b) == 3  # blocks 4, 5 revived, block 6 fresh
    bm.free_request(b)
    # evict block 5 from the window pool: the hit falls back to 5 blocks (token 80 reads 49..79:
    # blocks 3, 4); evict block 3 too: 4 blocks need 2, 3; 3 blocks need 1, 2
    bm.win.cached.pop(a.block_hashes[5])
    assert len(bm.match_prefix(_req("c", 100))) == 5
    bm.win.cached.pop(a.block_hashes[3])
    assert len(bm.match_prefix(_req("d", 100))) == 3


def test_layout_groups_parts_by_horizon():
    specs = [KVCacheSpec(1, 8, 8), KVCacheSpec(1, 8, 8, sliding_window=16),
             KVCacheSpec(1, 8, 0, sliding_window=16, planes=(CachePlane(1, 4, 8), CachePlane(4, 8)))]
    layout = KVLayout.plan(specs, bounded=True)
    assert layout.groups == ((FULL, FULL), (WINDOW, WINDOW), (WINDOW, WINDOW, WINDOW, FULL))
    assert layout.horizon == 16
    assert not KVLayout.plan(specs, bounded=False).grouped
    assert not KVLayout.plan(specs[:1], bounded=True).grouped  # nothing windowed: one group
    full, win = layout.bytes_per_block(specs, 16, torch.float32)
    assert full == 4 * (2 * 8 * 16 + 4 * 8) and win == 4 * (2 * 8 * 16 + 8 * 16 + 4 * 16)
    assert layout.blocks_per_request(1000, 16) == (63, 2)  # tokens 984..999: blocks 61, 62


def test_pool_sizes_split_the_bytes():
    specs = [KVCacheSpec(1, 8, 8, sliding_window=16), KVCacheSpec(1, 8, 0, planes=(CachePlane(4, 8),))]
    layout = KVLayout.plan(specs, bounded=True)
    per_full, per_win = layout.bytes_per_block(specs, 16, torch.float32)
    sizing = PoolSizing(16, 1 << 20, None, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024)
    full, win = pool_sizes(specs, layout, sizing, torch.float32)
    assert win == 2 * (4 * (1 + 2) + 64 // 16)  # twice a full batch: 4 windows of 1 (+2) blocks, one step's tokens
    assert full == ((1 << 20) - win * per_win) // per_full  # the rest
    big_chunks = PoolSizing(16, 1 << 20, None, max_num_seqs=1, max_num_batched_tokens=4096, max_model_len=8192)
    assert pool_sizes(specs, layout, big_chunks, torch.float32)[1] >= 4096 // 16 + 1  # a whole chunk fits
    assert pool_sizes(specs, layout, PoolSizing(16, 1 << 20, 13, 4, 64, 1024), torch.float32) == (13, 13)


def test_a_hit_without_its_window_tail_is_refused():
    bm = WindowedBlockManager(64, 16, True, window_blocks=16, horizon=32)
    a = _computed_and_freed(bm, 100)
    bm.win.cached.pop(a.block_hashes[2])  # a 3-block hit resumes at token 48, whose window reads blocks 1, 2
    b = _req("b", 100)
    hits = bm.cached_prefix(bm.full_block_hashes(b))[:3]  # the full pool has them; match_prefix would not
    with pytest.raises(ValueError, match="window tail"):
        bm.allocate(b, 100, hits)


@pytest.fixture(scope="module", params=["sliding", "mixed"])
def ckpt(request, tmp_path_factory: pytest.TempPathFactory):
    kinds = {} if request.param == "sliding" else dict(
        layer_types=MIXED, index_n_heads=8, index_topk=4,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})
    return str(write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4w"), seed=1, **kinds))


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(ps, params)]


def engine(ckpt: str, bounded: bool = True, **kw) -> LLM:
    kw = {"num_kv_blocks": KV_BLOCKS, "max_num_batched_tokens": 4096, **kw}
    return LLM(ckpt, tokenizer="smollm2", bound_sliding_window=bounded, **kw)


@pytest.fixture(scope="module")
def unbounded(ckpt):
    llm = engine(ckpt, bounded=False, enable_prefix_caching=False)
    return lambda ps, params=GREEDY: [tokens(llm, [p], params)[0] for p in ps]


def test_bounded_matches_unbounded_batched_and_chunked(ckpt, unbounded):
    ps = prompts(1, (300, 37, 140))
    expected = unbounded(ps)
    llm = engine(ckpt, enable_prefix_caching=False)
    assert llm.engine.kv_layout.grouped
    assert [tokens(llm, [p])[0] for p in ps] == expected  # single
    assert tokens(llm, ps) == expected  # batched
    chunked = engine(ckpt, enable_prefix_caching=False, max_num_batched_tokens=45)
    assert tokens(chunked, ps) == expected  # 45-token chunks through every prompt


def test_blocks_held_stay_bounded_while_context_grows(ckpt, unbounded):
    p = prompts(2, (200,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = engine(ckpt, enable_prefix_caching=False, max_num_batched_tokens=32)
    eng, bm = llm.engine, llm.engine.block_manager
    eng.add_request("r", p, params)
    out, held, full = [], [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.extend(o.new_token_ids)
        for r in eng.scheduler.running:
            held.append(bm.window_blocks_held(r))
            full.append(len(r.block_ids))
    assert out == unbounded([p], params)[0]
    # computing tokens [s, s + n) reads blocks (s - H + 1) // 16 .. (s + n - 1) // 16: at most
    # (n + H - 2) // 16 + 2 of them (H: 16 all-sliding, 32 mixed: the HCA rows), while the full
    # group grows with the context to ceil(263 / 16) = 17 blocks
    h = bm.horizon
    assert max(held) <= (32 + h - 2) // 16 + 2 and held[-1] <= (h - 1) // 16 + 2
    assert max(full) == 17
    assert bm.win.num_free_blocks == len(bm.win.blocks)  # all given back


def test_prefix_cache_hit_matches_cold_run(ckpt, unbounded):
    base = prompts(3, (150,))[0]
    branch = base[:100] + prompts(4, (40,))[0]  # shares 6 full blocks with base
    expected = unbounded([base, branch])
    llm = engine(ckpt)
    assert tokens(llm, [base]) == expected[:1]
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm, [branch]) == expected[1:]
    assert llm.engine.stats()["prefix_cache_hits"] == hits + 1
    assert tokens(llm, [base]) == expected[:1]
    # replay: evict the base's window blocks; the hit shrinks to what the window pool still has
    llm.engine.block_manager.win.reset_prefix_cache()
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert tokens(llm, [branch]) == expected[1:]
    assert llm.engine.stats()["prefix_cache_hits"] == hits  # no window tail: recomputed


def test_preemption_recompute_matches_unbounded(ckpt, unbounded, run_counting_preemptions):
    ps = prompts(5, (95, 94, 93))
    expected = unbounded(ps)
    llm = engine(ckpt, enable_prefix_caching=False, num_kv_blocks=13)
    out, preempted = run_counting_preemptions(llm.engine, ps, GREEDY)
    all_windowed = all(g == WINDOW for row in llm.engine.kv_layout.groups for g in row)
    # 13 blocks: the mixed model's full pool runs out (two 6-block prompts cross token 96); the
    # all-sliding toy holds 2 blocks a request once prefilled and never has to preempt
    assert preempted == 0 if all_windowed else preempted > 0
    assert out == expected


def test_kv_movement_moves_both_groups(ckpt, unbounded):
    """KV transfer on a grouped engine (all-sliding: no full-pool tensor at all; mixed): the payload
    holds the full blocks and the window's last ones; decode on another bounded engine == unbounded.
    Bounding is the default; the flag turns it off."""
    from moebus.engine.config import EngineConfig
    from moebus.kv.transfer import inject_prefilled, prefill

    assert EngineConfig().bound_sliding_window
    p = prompts(6, (150,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a, b = engine(ckpt).engine, engine(ckpt).engine
    assert a.kv and b.kv  # the KV connector is there
    pre = prefill(a, "p", p, params)
    ws = a.block_manager.first_live(150)
    assert pre.payload.window_start == ws > 0
    assert min(t.shape[0] for layer in pre.payload.layers for t in layer) == 10 - ws  # window tensors
    res = inject_prefilled(b, "d", p, pre.first_token, params, pre.payload)
    assert res.injected and res.num_tokens == 150, res.reason
    out = [pre.first_token]
    while b.has_unfinished_requests():
        out += [t for o in b.step() for t in o.new_token_ids]
    assert out == unbounded([p], params)[0]


def test_drafts_async_and_deterministic_modes_match_unbounded(ckpt, unbounded):
    """Rejected n-gram drafts write past the accepted tokens; async scheduling frees blocks while the
    previous step runs; deterministic mode gathers whole sequences (passed blocks read as block 0,
    masked out). Each gives the unbounded engine's tokens (and, deterministic, its logprobs)."""
    motif = prompts(6, (12,))[0]
    ps = [motif * 8 + motif[:5], prompts(7, (97,))[0]]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = unbounded(ps, params)
    spec = engine(ckpt, enable_prefix_caching=False, num_speculative_tokens=3)
    assert tokens(spec, ps, params) == expected
    assert spec.engine.spec_stats.num_accepted < spec.engine.spec_stats.num_draft_tokens  # some rejected
    assert tokens(engine(ckpt, async_scheduling=True, max_num_batched_tokens=45), ps, params) == expected
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=6, logprobs=1)
    det = [llm.generate(ps, sampled) for llm in (engine(ckpt, bounded=b, deterministic=True) for b in (False, True))]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in det[0]] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in det[1]]


@pytest.mark.parametrize("window", [6, 600])  # 600 > BANDED_MAX_WINDOW: gathered whole-sequence path
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_attend_on_windowed_tables_equals_full_tables(window, batch_invariant):
    """A sliding layer reads meta.windowed(): blocks its window has passed are -1 (read as block 0,
    here full of huge values) and must not change a bit of the output, for decode rows (batched),
    prefill chunks with cached context, and a fresh prompt."""
    from moebus.engine.attention import AttentionMetadata, attend

    bs, hkv, hq, d, horizon = 16, 2, 4, 8, window
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1300), (1, 900), (40, 1000), (25, 25)]  # (new tokens, context after the step)
    n_logical = sum(-(-L // bs) for _, L in shapes)
    full_k, full_v = (torch.randn(n_logical + 1, bs, hkv, d, generator=g) for _ in range(2))
    win_k, win_v = (torch.full_like(full_k, 1e4) for _ in range(2))  # block 0: the placeholder's garbage
    full_tables, win_tables, slots, win_slots, qsl, nxt = [], [], [], [], [0], 1
    for lq, L in shapes:
        nb = -(-L // bs)
        ids = list(range(nxt, nxt + nb))
        nxt += nb
        first_live = max(0, L - lq - horizon + 1) // bs
        win_ids = [-1] * first_live + ids[first_live:]
        for i in ids[first_live:]:  # the live blocks hold the same context in both layouts
            win_k[i], win_v[i] = full_k[i], full_v[i]
        full_tables.append(ids)
        win_tables.append(win_ids)
        slots += [ids[p // bs] * bs + p % bs for p in range(L - lq, L)]
        win_slots += [win_ids[p // bs] * bs + p % bs for p in range(L - lq, L)]
        qsl.append(qsl[-1] + lq)
    width = max(len(t) for t in full_tables)

    def tensor(tables):
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).clamp_(min=0)

    seq_lens = [L for _, L in shapes]
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    full = AttentionMetadata(qsl, seq_lens, torch.tensor(slots), tensor(full_tables), lens_t, bs,
                             batch_invariant=batch_invariant)
    windowed = AttentionMetadata(qsl, seq_lens, torch.tensor(win_slots), tensor(win_tables), lens_t, bs,
                                 batch_invariant=batch_invariant)
    grouped = AttentionMetadata(qsl, seq_lens, torch.zeros(qsl[-1], dtype=torch.long), tensor(full_tables) * 0,
                                lens_t, bs, batch_invariant=batch_invariant, window=windowed)
    q = torch.randn(qsl[-1], hq, d, generator=g)
    k, v = torch.randn(qsl[-1], hkv, d, generator=g), torch.randn(qsl[-1], hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    want = attend(q, k, v, (full_k, full_v), full, d ** -0.5, sliding_window=window, sinks=sinks)
    got = attend(q, k, v, (win_k, win_v), grouped, d ** -0.5, sliding_window=window, sinks=sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_n_choices_share_the_prompt_window(ckpt):
    """n > 1: the later choices wait for the first one's prefill and take its prompt blocks as a
    prefix hit, window tail included; sampled tokens equal the unbounded engine's."""
    p = prompts(8, (130,))[0]
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=8, n=3)
    runs = []
    for bounded in (False, True):
        llm = engine(ckpt, bounded=bounded)
        out = llm.generate([p], params)[0].outputs
        runs.append(([o.token_ids for o in out], llm.engine.stats()["prefix_cache_hits"]))
    assert runs[1] == runs[0] and runs[1][1] == 2  # both later choices hit
