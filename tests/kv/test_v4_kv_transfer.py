"""DeepSeek-V4 disaggregation: prefill on engine A, move every tensor of every layer's cache tuple
(k, v and the compressor / indexer planes), decode on engine B == one aggregated engine, greedy
32 tokens. The payload's wire format carries the per-layer layout, its version and checksums."""
from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from moebus.engine.kv_transfer import KVPayload, inject_prefilled, prefill
from moebus.engine.kv_transfer.codec import VERSION, KVVersionError
from moebus.kvtransport import ShmKVTransport, ShmTransportConfig

from .conftest import run
from .v4_fixtures import BLOCK, GREEDY32, WINDOW, plane_layout, v4_engine, v4_prompts, write_v4

LENGTHS = (140, 100)  # past several CSA (4) and HCA (32) windows and the 16-token sliding window


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_v4(tmp_path_factory.mktemp("v4kv"))


@pytest.fixture(scope="module")
def engines(ckpt):
    a, b = v4_engine(ckpt), v4_engine(ckpt)
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


def _over_shm(payload: KVPayload, tag: str) -> KVPayload:
    async def go() -> KVPayload:
        rx, tx = ShmKVTransport(ShmTransportConfig(address=f"moebus-v4kv-{tag}")), ShmKVTransport()
        await tx.send(payload, rx.address, tag)
        return await rx.receive(tag, 5)
    return asyncio.run(go())


@pytest.mark.parametrize("n", LENGTHS)
def test_v4_disaggregated_matches_aggregated(engines, reference, n):
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
    assert all(t.shape[0] == nb for layer in pre.payload.layers for t in layer)
    got = _over_shm(pre.payload, f"v4-{n}")
    assert got.equal(pre.payload) and got.corrupt_blocks == 0
    res = inject_prefilled(b, f"d{n}", prompt, pre.first_token, GREEDY32, got)
    assert res.injected, res.reason
    assert res.num_tokens == n and res.num_copied_blocks == nb
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
    for layers, why in ((short, "layer 1: 4 cache tensors, the cache 6"),
                        (wide, "layer 2 tensor 3: block shape (2, 32), the cache (1, 32)")):
        b.block_manager.reset_prefix_cache()
        bad = KVPayload(layers, BLOCK, n, prompt, namespace=pre.payload.namespace)
        res = inject_prefilled(b, "bad-d", prompt, pre.first_token, GREEDY32, bad)
        assert not res.injected and res.reason == why
        out = run(b, "bad-d")
        assert [pre.first_token] + out.tokens == reference[n]
        assert out.computed == n + GREEDY32.max_tokens - 1  # prompt + first token recomputed
    b.block_manager.reset_prefix_cache()


def test_v4_corrupt_plane_byte_is_caught_and_recomputed(engines, reference):
    """The block checksums cover the planes: one flipped bit in the last layer's indexer keys of
    block 3 ends the payload before block 3; the decode engine recomputes from there."""
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
    assert res.injected and res.num_tokens == 3 * BLOCK
    out = run(b, "crc-d")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == n - 3 * BLOCK + GREEDY32.max_tokens - 1  # the rest of the prompt, then decode
    b.block_manager.reset_prefix_cache()


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
    from moebus.engine.kv_transfer import codec
    from moebus.kvtransport import KVTransferError

    a, _ = engines
    pre = prefill(a, "ver-shm", v4_prompts(1, (40,))[0], GREEDY32)

    async def go() -> KVPayload:
        rx, tx = ShmKVTransport(ShmTransportConfig(address="moebus-v4kv-ver")), ShmKVTransport()
        with monkeypatch.context() as m:
            m.setattr(codec, "VERSION", VERSION + 1)  # the sender's build
            await tx.send(pre.payload, rx.address, "ver")
        return await rx.receive("ver", 5)

    with pytest.raises(KVTransferError, match=f"format version {VERSION + 1}; this build reads version {VERSION}"):
        asyncio.run(go())


def test_v4_chunked_prefill_and_a_partial_local_hit(ckpt, engines, reference):
    """Prefill in 45-token chunks (windows close across chunk edges) on one engine; the decode engine
    already caches the prompt's first 6 blocks, so only the payload's later blocks (every tensor of
    each, sliced alike) are copied."""
    _, b = engines
    n = LENGTHS[0]
    prompt = v4_prompts(0, LENGTHS)[0]
    chunked = v4_engine(ckpt, max_num_batched_tokens=45)
    try:
        pre = prefill(chunked, "chunk-p", prompt, GREEDY32)
    finally:
        chunked.close()
    assert pre.first_token == reference[n][0]
    b.block_manager.reset_prefix_cache()
    run(b, "warm-b", prompt[:100], GREEDY32)  # leaves 6 full prompt blocks in B's prefix cache
    res = inject_prefilled(b, "chunk-d", prompt, pre.first_token, GREEDY32, pre.payload)
    assert res.injected and res.num_local_hit_blocks == 6 and res.num_copied_blocks == -(-n // BLOCK) - 6
    out = run(b, "chunk-d")
    assert [pre.first_token] + out.tokens == reference[n]
    assert out.computed == GREEDY32.max_tokens - 1
    b.block_manager.reset_prefix_cache()
