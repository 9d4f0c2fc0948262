"""KV data integrity: bit flips and truncation in stored or moved KV blocks are never served.

Each corruption is injected where it would really happen (a stored file, a tensor held in host
memory, a payload's bytes); the block is dropped and counted, and a request over the damaged
prefix recomputes it and gives the tokens of an undamaged run.
"""
from __future__ import annotations

import asyncio
import os
import random

import nats
import pytest
import torch

from moebus.kv.hashing import kv_namespace, stable_block_hashes
from moebus.kv.payload import KVBlock, KVChecksumError, KVPayload
from moebus.kv.tiers.cpu import CpuTier
from moebus.kv.tiers.disk import DiskTier
from moebus.kv.tiers.load import load_prefix
from moebus.kv.tiers.offload import KVOffloader
from moebus.kv.tiers.store import TieredKVStore
from moebus.kv.transfer import inject_prefilled, prefill
from moebus.kv.transports.nats import NatsKVTransport
from moebus.kv.transports.transport import KVTransferError

from .conftest import BLOCK, GREEDY, run
from .test_kv_tiers import block, same
from .test_kv_transport import make_payload


def flip(buf: bytearray, pos: int, bit: int = 0) -> None:
    buf[pos] ^= 1 << bit


def flip_file(path: os.PathLike, pos: int, bit: int = 0) -> None:
    data = bytearray(open(path, "rb").read())
    flip(data, pos, bit)
    with open(path, "wb") as f:
        f.write(data)


def data_range(b: KVBlock) -> tuple[int, int]:
    """Where a block's tensor bytes lie in its encoding (the disk tier's file)."""
    p = b.packed()
    return p.data_start, p.nbytes


def block_data_pos(p: KVPayload, i: int) -> int:
    """A byte inside block i of the payload's first tensor (layer 0's keys)."""
    packed = p.packed()
    per_block = packed.specs[0]["nbytes"] // p.num_blocks
    return packed.data_start + packed.specs[0]["offset"] + i * per_block + per_block // 2


# --- tiers and payloads, no engine ----------------------------------------------------------
def test_disk_tier_serves_no_block_with_a_flipped_data_bit(tmp_path):
    # The reproduction: 10 stored blocks, one bit flipped in each one's tensor data.
    hits: list[str] = []
    tier = DiskTier(tmp_path, 10 << 20, on_corrupt=hits.append)
    rng = random.Random(0)
    for h in range(10):
        tier.put(h, block(h))
        lo, hi = data_range(block(h))
        flip_file(tmp_path / f"{h:016x}.kvb", rng.randrange(lo, hi), rng.randrange(8))
    assert [tier.get(h) for h in range(10)] == [None] * 10
    assert tier.corrupt == 10 and hits == ["disk"] * 10 and len(tier) == 0 and not list(tmp_path.iterdir())


def test_disk_tier_drops_truncated_and_header_damaged_files(tmp_path):
    tier = DiskTier(tmp_path, 10 << 20)
    for h in range(4):
        tier.put(h, block(h))
    path = [tmp_path / f"{h:016x}.kvb" for h in range(4)]
    os.truncate(path[0], os.path.getsize(path[0]) - 7)  # a torn write that still got renamed
    os.truncate(path[1], 0)  # a crash before the data reached the disk (no fsync)
    flip_file(path[2], 20)  # a bit in the JSON header
    assert [tier.get(h) for h in range(3)] == [None] * 3 and tier.corrupt == 3
    assert same(tier.get(3), block(3)) and tier.hits == 1 and tier.misses == 3
    path[3].unlink()  # removed by hand: a plain miss, not corruption
    assert tier.get(3) is None and tier.corrupt == 3


def test_disk_write_is_atomic_and_a_failed_write_is_not_kept(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 10 << 20, fsync=True)
    tier.put(1, block(1))

    def no_room(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    assert [h for h, _ in tier.put(2, block(2))] == [2]  # handed on, as if too large
    assert 2 not in tier and sorted(p.name for p in tmp_path.iterdir()) == [f"{1:016x}.kvb"]
    monkeypatch.undo()
    assert same(DiskTier(tmp_path, 10 << 20).get(1), block(1))


def test_cpu_tier_drops_a_block_damaged_in_memory_and_the_store_falls_back(tmp_path):
    cpu = CpuTier(10 << 20)
    store = TieredKVStore([cpu, DiskTier(tmp_path, 10 << 20)], write_through=True)
    for h in range(3):
        store.put(h, block(h))
    cpu._blocks[1].layers[2][1].view(torch.uint8).view(-1)[5] ^= 0x10  # bfloat16 values, in place
    assert same(store.get(1), block(1))  # the disk's intact copy is served (and promoted again)
    assert cpu.corrupt == 1 and store.stats()["cpu"]["corrupt"] == 1 and store.where(1) == "cpu"
    cpu._blocks[0].layers[0][0].view(-1)[0] += 1e-3  # one float, off by a little
    store.tiers[1].discard(0)
    assert store.get(0) is None and cpu.corrupt == 2 and 0 not in store


def test_payload_keeps_the_blocks_before_a_corrupt_one():
    p = make_payload(num_blocks=5)
    assert KVPayload.from_bytes(p.to_bytes()).corrupt_blocks == 0
    buf = p.to_bytes()
    flip(buf, block_data_pos(p, 2), 3)
    flip(buf, block_data_pos(p, 4), 0)
    q = KVPayload.from_bytes(buf)
    assert q.corrupt_blocks == 2 and q.num_blocks == 2 and q.num_tokens == 2 * 16
    assert q.token_ids == p.token_ids[:32] and q.block_hashes == p.block_hashes[:2]
    assert all(same(q.block(i), p.block(i)) for i in range(2)) and q.block(1).checksum == p.block_checksums[1]
    first = p.to_bytes()
    flip(first, block_data_pos(p, 0))
    assert KVPayload.from_bytes(first).num_blocks == 0  # nothing usable: the receiver recomputes all


def test_payload_header_and_generator_damage_raise():
    p = make_payload()
    for pos in (3, 9, 40, p.packed().data_start - 80):  # magic, header length, header JSON
        buf = p.to_bytes()
        flip(buf, pos)
        with pytest.raises(ValueError):
            KVPayload.from_bytes(buf)
    buf = p.to_bytes()
    packed = p.packed()
    flip(buf, packed.data_start + packed.specs[-1]["offset"] + 1)  # the generator state
    with pytest.raises(KVChecksumError):
        KVPayload.from_bytes(buf)


def test_blocks_keep_the_checksum_they_were_made_with():
    b = block(3)
    q = KVPayload.from_blocks([block(2), b], [7, 8], 4)
    keyed = b.keyed(8).checksum  # its data checksum with the identity it travels under (hash 8)
    assert q.block(1).checksum == keyed and KVBlock.decode(q.block(1).encode()).checksum == keyed
    b.layers[0][0][0, 0, 0] += 1  # changed after it was made: every later check sees it
    with pytest.raises(KVChecksumError):
        KVBlock.decode(b.encode())
    assert not KVPayload.from_blocks([b], [8], 4).block(0).intact()


# --- a real engine: the request still gives the undamaged run's tokens -----------------------
def _offload(engine, rid, prompt, store) -> list[int]:
    """Run the prompt once, offloading its blocks; the hashes of those load_prefix would use."""
    off = KVOffloader(store)
    engine.block_manager.reset_prefix_cache()
    run(engine, rid, prompt, after_step=lambda: off.offload(engine))
    engine.block_manager.reset_prefix_cache()
    full = (len(prompt) - 1) // BLOCK  # the last prompt token always runs
    hashes = stable_block_hashes(prompt[: full * BLOCK], BLOCK, kv_namespace(engine))
    assert store.longest_prefix(hashes) == full
    return hashes


def _warm(engine, rid, prompt, store) -> tuple[int, list[int], int]:
    loaded: list[int] = []
    out = run(engine, rid, prompt, before_step=lambda: loaded.append(load_prefix(engine, rid, store)))
    engine.block_manager.reset_prefix_cache()
    return loaded[0], out.tokens, out.computed


def test_disk_tier_corruption_is_recomputed_with_the_same_output(engine_b, prompt, reference, tmp_path):
    disk = DiskTier(tmp_path, 64 << 20)
    store = TieredKVStore([disk])
    files = [tmp_path / f"{h:016x}.kvb" for h in _offload(engine_b, "disk-cold", prompt, store)]
    flip_file(files[1], os.path.getsize(files[1]) - 100, 6)  # block 1's tensor data
    n, tokens, computed = _warm(engine_b, "disk-flip", prompt, store)
    assert n == BLOCK and tokens == reference and disk.corrupt == 1  # block 0 only; 1.. recomputed
    assert computed == len(prompt) - BLOCK + GREEDY.max_tokens - 1 and not files[1].exists()

    _offload(engine_b, "disk-again", prompt, store)  # block 1 is written again
    os.truncate(files[0], os.path.getsize(files[0]) // 2)
    n, tokens, computed = _warm(engine_b, "disk-cut", prompt, store)
    assert n == 0 and tokens == reference and disk.corrupt == 2
    assert computed == len(prompt) + GREEDY.max_tokens - 1


def test_cpu_tier_corruption_is_recomputed_with_the_same_output(engine_b, prompt, reference):
    cpu = CpuTier(64 << 20)
    store = TieredKVStore([cpu])
    hashes = _offload(engine_b, "cpu-cold", prompt, store)
    assert len(hashes) == 3
    # A key in layer 7 of the third block, one bit flipped in place in host memory.
    cpu._blocks[hashes[2]].layers[7][0].view(torch.uint8).view(-1)[123] ^= 0x80
    n, tokens, computed = _warm(engine_b, "cpu-flip", prompt, store)
    assert n == 2 * BLOCK and tokens == reference and cpu.corrupt == 1 and hashes[2] not in cpu
    assert computed == len(prompt) - 2 * BLOCK + GREEDY.max_tokens - 1


async def _send_bytes(url: str, body: bytearray, corrupt_chunk: bool = False) -> KVPayload:
    a, b = await nats.connect(url), await nats.connect(url)
    try:
        rx = await NatsKVTransport(b, "moebus.v1.kvtransfer.push.integrity").start()
        tx = NatsKVTransport(a, None)
        if corrupt_chunk:  # flipped on the wire, after the sender's CRC-32 of the whole body
            publish = a.publish

            async def flipping(subject, data=b"", reply="", headers=None):
                data = bytearray(data)
                if data:  # (credit requests carry no bytes)
                    flip(data, len(data) // 2)
                await publish(subject, bytes(data), reply, headers)

            a.publish = flipping
        await tx.send_bytes(body, rx.address, "t-1")
        return await rx.receive("t-1", 5)
    finally:
        await a.close()
        await b.close()


def test_transfer_with_a_corrupt_block_recomputes_from_it(engine_a, engine_b, prompt, reference, nats_server):
    engine_b.block_manager.reset_prefix_cache()
    pre = prefill(engine_a, "p-flip", prompt, GREEDY)
    body = pre.payload.to_bytes()
    flip(body, block_data_pos(pre.payload, 2), 5)  # damaged in the sender's memory after packing
    got = asyncio.run(_send_bytes(nats_server.url, body))
    assert got.corrupt_blocks == 1 and got.num_tokens == 2 * BLOCK
    res = inject_prefilled(engine_b, "d-flip", prompt, pre.first_token, GREEDY, got)
    assert res.injected and res.num_tokens == 2 * BLOCK
    out = run(engine_b, "d-flip")
    assert [pre.first_token] + out.tokens == reference
    assert out.computed == len(prompt) - 2 * BLOCK + GREEDY.max_tokens - 1
    engine_b.block_manager.reset_prefix_cache()

    with pytest.raises(KVTransferError, match="checksum"):  # flipped in flight: the whole transfer fails
        asyncio.run(_send_bytes(nats_server.url, pre.payload.to_bytes(), corrupt_chunk=True))
    res = inject_prefilled(engine_b, "d-lost", prompt, pre.first_token, GREEDY, None)
    assert not res.injected and [pre.first_token] + run(engine_b, "d-lost").tokens == reference
    engine_b.block_manager.reset_prefix_cache()
