"""KVPayload encoding and both transports: bitwise round trips, failures, throughput."""
from __future__ import annotations

import asyncio
import glob
import json
import time
import zlib

import nats
import pytest
import torch

from moebus.kv.hashing import stable_block_hashes
from moebus.kv.payload import KVPayload
from moebus.kv.transports.nats import (
    H_BYTES,
    H_CRC,
    H_ID,
    H_SEQ,
    H_TOTAL,
    H_WANT,
    NatsKVTransport,
    NatsTransportConfig,
)
from moebus.kv.transports.shm import ShmKVTransport, ShmTransportConfig
from moebus.kv.transports.transport import KVTransferError, KVTransferTimeout


def make_payload(num_blocks: int = 5, layers: int = 4, heads: int = 3, dim: int = 64, seed: int = 0) -> KVPayload:
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(num_blocks, 16, heads, dim, generator=g),
           torch.randn(num_blocks, 16, heads, dim + 17, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    n = num_blocks * 16 - 5
    toks = list(range(100, 100 + n))
    return KVPayload(kv, 16, n, toks, stable_block_hashes(toks, 16, "ns"), "ns", "req-1", 42,
                     torch.Generator().manual_seed(7).get_state())


def test_stable_hashes_are_fixed_across_processes():
    # Golden values: a chain hash must not depend on the process (Python's hash(None) does).
    assert stable_block_hashes(list(range(40)), 16, "smollm2|float32|16") == [4027986365126632677,
                                                                             6752982584932932632]
    known = stable_block_hashes(list(range(20)), 16, "x")
    assert stable_block_hashes(list(range(40)), 16, "x", known) == stable_block_hashes(list(range(40)), 16, "x")
    assert stable_block_hashes(list(range(40)), 16, "y")[0] != known[0]


def test_payload_bytes_and_chunks_round_trip_bitwise():
    p = make_payload()
    assert KVPayload.from_bytes(p.to_bytes()).equal(p)
    chunks = [bytes(c) for c in p.chunks(4096)]
    assert len(chunks) > 10 and all(len(c) == 4096 for c in chunks[:-1])
    q = KVPayload.from_chunks(chunks)
    assert q.equal(p) and torch.equal(q.generator_state, p.generator_state)
    with pytest.raises(ValueError):
        KVPayload.from_bytes(p.to_bytes()[:-100])
    with pytest.raises(ValueError):
        KVPayload([], 16, 1)


async def test_nats_transport_round_trip_and_throughput(nats_server):
    a, b = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        small = NatsTransportConfig(chunk_bytes=16 * 1024, grant_bytes=48 * 1024, credit_bytes=64 * 1024)
        rx = await NatsKVTransport(b, "moebus.v1.kvtransfer.push.test-rx", small).start()
        tx = NatsKVTransport(a, None, small)
        p = make_payload()
        await tx.send(p, rx.address, "t-small")  # many chunks, several grants
        assert (await rx.receive("t-small", 5)).equal(p)

        big = make_payload(num_blocks=64, layers=30, seed=1)  # ~40 MB
        tx_big = NatsKVTransport(a, None, NatsTransportConfig())
        rx_big = await NatsKVTransport(b, "moebus.v1.kvtransfer.push.test-rx-big").start()  # default credit
        t0 = time.perf_counter()
        recv = asyncio.create_task(rx_big.receive("t-big", 30))
        await tx_big.send(big, rx_big.address, "t-big")
        got = await recv
        dt = time.perf_counter() - t0
        assert got.equal(big)
        print(f"\nNATS KV transfer: {big.nbytes / 1e6:.1f} MB in {dt * 1e3:.0f} ms = {big.nbytes / dt / 1e6:.0f} MB/s "
              f"({tx_big.chunk_size() // 1024} KiB chunks)")
        await rx.close()
        await rx_big.close()
    finally:
        await a.close()
        await b.close()


async def test_nats_transport_failures(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        tx = NatsKVTransport(nc, None, NatsTransportConfig(ack_timeout_s=1.0))
        with pytest.raises(KVTransferError, match="no KV receiver"):
            await tx.send(make_payload(), "moebus.v1.kvtransfer.push.nobody", "t0")
        rx = await NatsKVTransport(nc, "moebus.v1.kvtransfer.push.rx2").start()
        with pytest.raises(KVTransferTimeout):
            await rx.receive("never", timeout=0.2)
        body = bytes(make_payload().to_bytes())  # one chunk with a wrong checksum
        hdr = {H_ID: "bad", H_SEQ: "0", H_TOTAL: "1", H_BYTES: str(len(body)), H_CRC: str(zlib.crc32(body) ^ 1)}
        grant = await nc.request(rx.address, b"", timeout=2, headers={H_ID: "bad", H_WANT: str(len(body))})
        assert json.loads(grant.data) == {"ok": True, "grant": len(body), "capacity": NatsTransportConfig().credit_bytes}
        reply = await nc.request(rx.address, body, timeout=2, headers=hdr)
        assert b'"ok": false' in reply.data and b"checksum" in reply.data
        with pytest.raises(KVTransferError, match="checksum"):
            await rx.receive("bad", timeout=1)
        await rx.close()
    finally:
        await nc.close()


async def test_shm_transport_round_trip_cleanup_and_throughput():
    rx = ShmKVTransport(ShmTransportConfig(address="moebus-kv-test"))
    tx = ShmKVTransport()
    p = make_payload()
    await tx.send(p, rx.address, "t1")
    assert (await rx.receive("t1", 2)).equal(p)
    with pytest.raises(KVTransferError):  # same transfer twice in flight
        await tx.send(p, rx.address, "t2")
        await tx.send(p, rx.address, "t2")
    await tx.close()  # unlinks t2, which nobody claimed
    with pytest.raises(KVTransferTimeout):
        await rx.receive("t2", timeout=0.05)
    big = make_payload(num_blocks=64, layers=30, seed=1)
    t0 = time.perf_counter()
    await tx.send(big, rx.address, "t-big")
    got = await rx.receive("t-big", 5)
    dt = time.perf_counter() - t0
    assert got.equal(big)
    print(f"\nshared-memory KV transfer: {big.nbytes / 1e6:.1f} MB in {dt * 1e3:.0f} ms = "
          f"{big.nbytes / dt / 1e6:.0f} MB/s")
    assert not glob.glob("/dev/shm/moebus-kv-test-*")
