from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request
from moebus.engine.sampling import SamplingParams


def _req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    r = _req(range(10))
    assert bm.can_allocate(r, 10)
    bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    bm.free_request(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    bm = BlockManager(16, 4)
    a = _req(range(12), "a")
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_blocks(a)
    b = _req(list(range(12)) + [99, 98], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_ids[:3]
    bm.allocate(b, b.num_tokens, hits)
    assert b.num_cached_tokens == 12 and b.block_ids[:3] == a.block_ids
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_ids)
    # an identical prompt must still compute its last token: only 2 of 3 full blocks are reused
    c = _req(range(12), "c")
    assert len(bm.match_prefix(c)) == 2


def test_different_prefix_misses():
    bm = BlockManager(16, 4)
    a = _req(range(8), "a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_blocks(a)
    assert bm.match_prefix(_req([1000, 1, 2, 3, 4, 5, 6, 7, 8], "b")) == []


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 2)
    a = _req(range(4), "a")
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.cache_blocks(a)
    bm.free_request(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    hit = bm.match_prefix(_req([0, 1, 2, 3, 7], "b"))
    assert hit == a.block_ids[:2] or len(hit) == 2
    # filling all memory with other tokens evicts the cached blocks
    c = _req(range(100, 108), "c")
    bm.allocate(c, 8)
    assert bm.cached == {} and bm.num_free_blocks == 0


def test_uncomputed_blocks_are_not_published():
    bm = BlockManager(8, 4)
    a = _req(range(12), "a")
    bm.allocate(a, 12)
    a.num_computed_tokens = 5  # a chunk computed only the first block
    bm.cache_blocks(a)
    assert len(bm.cached) == 1


def test_cached_prefix_and_allocation_counters():
    bm = BlockManager(8, 4)
    a = _req(range(12), "a")
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_blocks(a)
    hashes = bm.full_block_hashes(a)
    assert bm.cached_prefix(hashes[:2] + [12345] + hashes[2:]) == a.block_ids[:2]
    assert bm.is_cached(hashes[0]) and not bm.is_cached(12345) and bm.queries == 0
    assert bm.num_free_of(a.block_ids) == 0 and bm.allocated == 3
    bm.free_request(a)
    b = _req(list(range(12)) + [5], "b")
    hits = bm.match_prefix(b)
    assert bm.num_free_of(hits) == 3
    bm.allocate(b, b.num_tokens, hits)
    assert bm.allocated == 4  # the three cached blocks were reused, one fresh block taken
