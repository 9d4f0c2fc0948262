"""DeepSeek-V4 disaggregation: prefill on engine A, move every tensor of every layer's cache tuple
(k, v and the compressor / indexer planes), decode on engine B == one aggregated engine, greedy
32 tokens. The payload's wire format carries the per-layer layout, its version and checksums.

Every test runs bounded (the default: sliding K/V and compressor rows in a windowed pool, only the
blocks the next token's window reads move) and unbounded (one pool, every block of every tensor)."""
from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from moebus.kv.cache_io import kv_block_ids
from moebus.kv.encoding import VERSION, KVVersionError
from moebus.kv.groups import WINDOW as WINDOW_GROUP
from moebus.kv.payload import KVPayload
from moebus.kv.transfer import inject_prefilled, prefill
from moebus.kv.transports.shm import ShmKVTransport, ShmTransportConfig

from .conftest import over_shm, run
from .v4_fixtures import BLOCK, GREEDY32, WINDOW, plane_layout, v4_engine, v4_prompts, write_v4

LENGTHS = (140, 100)  # past several CSA (4) and HCA (32) windows and the 16-token sliding window


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_v4(tmp_path_factory.mktemp("v4kv"))


@pytest.fixture(scope="module", params=[True, False], ids=["bounded", "unbounded"])
def bounded(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def engines(ckpt, bounded):
    a, b = v4_engine(ckpt, bound_sliding_window=bounded), v4_engine(ckpt, bound_sliding_window=bounded)
    assert a.kv_layout.grouped == bounded
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def reference(engines) -> dict[int, list[int]]:
    """Greedy tokens of each prompt on one aggregated engine (B itself, cold)."""
    _, b = engines
    out = {}
    for n, p in zip(LENGTHS, v4_prompts(0, LENGTHS), strict=True):
        b.block_manager.reset_prefix_cache()
        out[n] = run(b, f"ref-{n}", p, GREEDY32).tokens
    b.block_manager.reset_prefix_cache()
    assert all(len(t) == 32 for t in out.values())
    return out


@pytest.mark.parametrize("n", LENGTHS)
def test_v4_disaggregated_matches_aggregated(engines, reference, bounded, n):
    a, b = engines
    prompt = v4_prompts(0, LENGTHS)[LENGTHS.index(n)]
    assert n > 3 * 32 and n > WINDOW
    b.block_manager.reset_prefix_cache()
    pre = prefill(a, f"p{n}", prompt, GREEDY32)
    assert pre.first_token == reference[n][0] and not a.has_unfinished_requests()
    layout = [len(layer) for layer in pre.payload.layers]
    assert layout == plane_layout(a) == [2, 6, 4, 6]  # sliding; CSA + indexer; HCA; CSA + indexer
    rows = {t.shape[1] for layer in pre.payload.layers for t in layer}
    assert rows == {BLOCK, 4, 1}  # CSA entries: 4 rows a block, HCA: 1 row a block (rate 32)
    nb = -(-n // BLOCK)
    # windowed tensors: only the blocks token n's window (horizon 32) reads, 6 on (140) or 4 on (100)
    ws = (n - 32 + 1) // BLOCK if bounded else 0
    assert pre.payload.window_start == ws and (pre.payload.groups is not None) == bounded
    groups = a.kv_layout.groups
    assert all(t.shape[0] == nb - (ws if groups[i][j] == WINDOW_GROUP else 0)
               for i, layer in enumerate(pre.payload.layers) for j, t in enumerate(layer))
    got = over_shm(pre.payload, f"moebus-v4kv-v4-{n}", f"v4-{n}")
    assert got.equal(pre.payload) and got.corrupt_blocks == 0
    res = inject_prefilled(b, f"d{n}", prompt, pre.first_token, GREEDY32, got)
    assert res.injected, res.reason
    assert res.num_tokens == n and res.num_copied_blocks == nb
    if bounded:
        window = kv_block_ids(b.get_request(f"d{n}"), WINDOW_GROUP)
        assert window[:ws] == [-1] * ws and min(window[ws:nb]) >= 0  # passed blocks never held
    out = run(b, f"d{n}")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == GREEDY32.max_tokens - 1  # decode steps only: no prompt recompute
    b.block_manager.reset_prefix_cache()


def test_v4_payload_missing_a_plane_or_of_another_shape_is_recomputed(engines, reference):
    a, b = engines
    n = LENGTHS[1]
    prompt = v4_prompts(0, LENGTHS)[1]
    pre = prefill(a, "bad-p", prompt, GREEDY32)
    short = [layer[:4] if i == 1 else layer for i, layer in enumerate(pre.payload.layers)]  # no indexer planes
    wide = [(*layer[:3], torch.cat([layer[3]] * 2, 1)) if i == 2 else layer  # 2 HCA entry rows a block
            for i, layer in enumerate(pre.payload.layers)]
    g = pre.payload.groups
    for layers, why in ((short, "layer 1: 4 cache tensors, the cache 6"),
                        (wide, "layer 2 tensor 3: block shape (2, 32), the cache (1, 32)")):
        b.block_manager.reset_prefix_cache()
        groups = [gs[: len(layer)] for gs, layer in zip(g, layers, strict=True)] if g is not None else None
        bad = KVPayload(layers, BLOCK, n, prompt, namespace=pre.payload.namespace, groups=groups,
                        window_start=pre.payload.window_start)
        res = inject_prefilled(b, "bad-d", prompt, pre.first_token, GREEDY32, bad)
        assert not res.injected and res.reason == why
        out = run(b, "bad-d")
        assert [pre.first_token] + out.tokens == reference[n]
        assert out.computed == n + GREEDY32.max_tokens - 1  # prompt + first token recomputed
    b.block_manager.reset_prefix_cache()


def test_v4_corrupt_plane_byte_is_caught_and_recomputed(engines, reference, bounded):
    """The block checksums cover the planes: one flipped bit in the last layer's indexer keys of
    block 3 ends the payload before block 3; the decode engine recomputes from there (bounded: the
    3 blocks left lack the window tail of token 48, so the whole prompt is recomputed)."""
    a, b = engines
    n = LENGTHS[0]
    prompt = v4_prompts(0, LENGTHS)[0]
    pre = prefill(a, "crc-p", prompt, GREEDY32)
    buf = pre.payload.to_bytes()
    ikeys = pre.payload.layers[3][5]  # [num_blocks, 4 rows, index_head_dim]
    per_block = ikeys[0].numel() * ikeys.element_size()
    gen = pre.payload.generator_state
    assert gen is None  # greedy: the indexer keys are the encoding's last blob
    buf[len(buf) - (ikeys.shape[0] - 3) * per_block + 5] ^= 0x20
    got = KVPayload.from_bytes(buf)
    assert got.corrupt_blocks == 1 and got.num_blocks == 3 and got.num_tokens == 3 * BLOCK
    b.block_manager.reset_prefix_cache()
    res = inject_prefilled(b, "crc-d", prompt, pre.first_token, GREEDY32, got)
    out = run(b, "crc-d")
    assert [pre.first_token] + out.tokens == reference[n]
    if bounded:
        assert not res.injected and res.reason == "payload lacks the window blocks 1..2 of its 48 tokens"
        assert out.computed == n + GREEDY32.max_tokens - 1  # prompt + first token recomputed
    else:
        assert res.injected and res.num_tokens == 3 * BLOCK
        assert out.computed == n - 3 * BLOCK + GREEDY32.max_tokens - 1  # the rest of the prompt, then decode
    b.block_manager.reset_prefix_cache()


def test_v4_corrupt_window_block_keeps_the_rest_of_the_window(engines, reference, bounded):
    """A flipped bit in the sliding layer's v of the last block (a windowed tensor when bounded)
    ends the payload at block 8: its 128 tokens' window (blocks 6, 7) is still there, so only the
    last 12 prompt tokens are recomputed."""
    a, b = engines
    n = LENGTHS[0]
    prompt = v4_prompts(0, LENGTHS)[0]
    pre = prefill(a, "crcw-p", prompt, GREEDY32)
    v = pre.payload.layers[0][1]  # [blocks held, 16, Hkv, Dv]
    assert v.shape[0] == (3 if bounded else 9)
    packed = pre.payload.packed()
    spec = packed.specs[1]  # the sliding layer's v: the encoding's second blob
    per_block = spec["nbytes"] // v.shape[0]
    buf = packed.to_bytes()
    buf[packed.data_start + spec["offset"] + (v.shape[0] - 1) * per_block + 7] ^= 0x10
    got = KVPayload.from_bytes(buf)
    assert got.corrupt_blocks == 1 and got.num_blocks == 8 and got.num_tokens == 8 * BLOCK
    b.block_manager.reset_prefix_cache()
    res = inject_prefilled(b, "crcw-d", prompt, pre.first_token, GREEDY32, got)
    assert res.injected and res.num_tokens == 8 * BLOCK, res.reason
    out = run(b, "crcw-d")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == n - 8 * BLOCK + GREEDY32.max_tokens - 1
    b.block_manager.reset_prefix_cache()


def test_v4_bounded_payload_is_refused_by_an_unbounded_engine(ckpt, engines, reference, bounded):
    """An engine that keeps whole windows cannot take a payload holding only the last ones: it
    recomputes (same tokens). The other way round (every block sent) works: the tail is taken."""
    a, b = engines
    n = LENGTHS[1]
    prompt = v4_prompts(0, LENGTHS)[1]
    pre = prefill(a, "mix-p", prompt, GREEDY32)
    other = v4_engine(ckpt, bound_sliding_window=not bounded)
    try:
        res = inject_prefilled(other, "mix-d", prompt, pre.first_token, GREEDY32, pre.payload)
        out = run(other, "mix-d")
    finally:
        other.close()
    assert [pre.first_token] + out.tokens == reference[n]
    if bounded:
        assert not res.injected and "keeps whole windows" in res.reason
        assert out.computed == n + GREEDY32.max_tokens - 1
    else:
        assert res.injected and res.num_tokens == n, res.reason
        assert out.computed == GREEDY32.max_tokens - 1


def test_v4_wire_version_mismatch_is_refused_clearly(engines):
    a, _ = engines
    pre = prefill(a, "ver-p", v4_prompts(1, (40,))[0], GREEDY32)
    buf = pre.payload.to_bytes()
    assert KVPayload.from_bytes(buf).equal(pre.payload)
    struct.pack_into("<H", buf, 4, VERSION - 1)  # the u16 after the magic
    with pytest.raises(KVVersionError, match=f"format version {VERSION - 1}; this build reads version {VERSION}"):
        KVPayload.from_bytes(buf)


def test_v4_payload_from_another_format_version_fails_the_transfer(engines, monkeypatch):
    """A receiver of another build reports a failed transfer (the decode worker then recomputes),
    never a decoded payload or a stray ValueError."""
    from moebus.kv import encoding
    from moebus.kv.transports.transport import KVTransferError

    a, _ = engines
    pre = prefill(a, "ver-shm", v4_prompts(1, (40,))[0], GREEDY32)

    async def go() -> KVPayload:
        rx, tx = ShmKVTransport(ShmTransportConfig(address="moebus-v4kv-ver")), ShmKVTransport()
        with monkeypatch.context() as m:
            m.setattr(encoding, "VERSION", VERSION + 1)  # the sender's build
            await tx.send(pre.payload, rx.address, "ver")
        return await rx.receive("ver", 5)

    with pytest.raises(KVTransferError, match=f"format version {VERSION + 1}; this build reads version {VERSION}"):
        asyncio.run(go())


def test_v4_chunked_prefill_and_a_partial_local_hit(ckpt, engines, reference, bounded):
    """Prefill in 45-token chunks (windows close across chunk edges) on one engine; the decode engine
    already caches the prompt's first 6 blocks, so only the payload's later blocks (every tensor of
    each, sliced alike) are copied."""
    _, b = engines
    n = LENGTHS[0]
    prompt = v4_prompts(0, LENGTHS)[0]
    chunked = v4_engine(ckpt, max_num_batched_tokens=45, bound_sliding_window=bounded)
    try:
        pre = prefill(chunked, "chunk-p", prompt, GREEDY32)
    finally:
        chunked.close()
    assert pre.first_token == reference[n][0]
    b.block_manager.reset_prefix_cache()
    run(b, "warm-b", prompt[:100], GREEDY32)  # leaves 6 full prompt blocks in B's prefix cache
    res = inject_prefilled(b, "chunk-d", prompt, pre.first_token, GREEDY32, pre.payload)
    assert res.injected and res.num_local_hit_blocks == 6 and res.num_copied_blocks == -(-n // BLOCK) - 6
    window = kv_block_ids(b.get_request("chunk-d"), WINDOW_GROUP)
    if b.kv_layout.grouped:  # the window of token 140 reads blocks 6..8: the hit's 6 is not, so all come from A
        assert window[:6] == [-1] * 6 and min(window[6:9]) >= 0 and pre.payload.window_start == 6
    out = run(b, "chunk-d")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == GREEDY32.max_tokens - 1
    b.block_manager.reset_prefix_cache()


def test_v4_local_hit_reaching_into_the_window(engines, reference, bounded):
    """The decode engine caches the prompt's first 8 blocks, window parts included: bounded, the
    window of token 140 (blocks 6..8) takes 6, 7 from the local hit and only block 8 from A."""
    a, b = engines
    n = LENGTHS[0]
    prompt = v4_prompts(0, LENGTHS)[0]
    pre = prefill(a, "deep-p", prompt, GREEDY32)
    b.block_manager.reset_prefix_cache()
    run(b, "warm-deep", prompt[:130], GREEDY32)  # 8 full prompt blocks in B's prefix cache
    res = inject_prefilled(b, "deep-d", prompt, pre.first_token, GREEDY32, pre.payload)
    assert res.injected and res.num_local_hit_blocks == 8 and res.num_copied_blocks == 1, res.reason
    if bounded:
        window = kv_block_ids(b.get_request("deep-d"), WINDOW_GROUP)
        assert window[:6] == [-1] * 6 and min(window[6:9]) >= 0
    out = run(b, "deep-d")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == GREEDY32.max_tokens - 1
    b.block_manager.reset_prefix_cache()
