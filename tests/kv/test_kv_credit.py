"""Credit-based KV flow control (issue #23 item 2) against a real nats-server whose per-client
MaxPending is small (4 MiB), so a receiver that falls behind is cut off as a slow consumer
unless the senders wait for credit: many concurrent transfers to one slow receiver keep its
in-flight bytes under its credit and never trip the server; a flood that ignores credit does
(the check can fail); a sender SIGKILLed mid-transfer gives its credit back in seconds."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from moebus.kv.payload import KVPayload
from moebus.kv.transports.credit import ByteCredits
from moebus.kv.transports.nats import NatsKVTransport, NatsTransportConfig
from moebus.shared.nats_server import find_nats_server, free_port

from .test_kv_transport import make_payload

KIB, MIB = 1024, 1024 * 1024
RX = "moebus.v1.kvtransfer.push.slow-rx"
CFG = NatsTransportConfig(chunk_bytes=64 * KIB, grant_bytes=256 * KIB, credit_bytes=1 * MIB, chunk_idle_s=1.0,
                          grant_timeout_s=60.0, ack_timeout_s=60.0)


class TightServer:
    """A nats-server with max_pending 4 MiB (its default is 64 MiB), logging to a file."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.port = free_port()
        self.log = Path(self.dir.name) / "nats.log"
        conf = Path(self.dir.name) / "nats.conf"
        conf.write_text("max_pending: 4194304\nmax_payload: 1048576\n")
        self.proc = subprocess.Popen([find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        self.url = f"nats://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while "Server is ready" not in self.log.read_text():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)

    def slow_consumers(self) -> int:
        return self.log.read_text().count("Slow Consumer Detected")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.dir.cleanup()


@pytest.fixture
def tight() -> Iterator[TightServer]:
    s = TightServer()
    yield s
    s.close()


class SlowReceiver:
    """A receiving transport on its own thread and event loop; every completed payload blocks
    that loop for `block_s` (a busy process that does not read its socket meanwhile)."""

    def __init__(self, url: str, block_s: float) -> None:
        self.url, self.block_s = url, block_s
        self.got: dict[str, KVPayload] = {}
        self.rx: NatsKVTransport | None = None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        self.nc = await nats.connect(self.url)

        async def on_payload(tid: str, p: KVPayload) -> None:
            self.got[tid] = p
            time.sleep(self.block_s)  # blocks this loop: nothing is read from the socket

        self.rx = await NatsKVTransport(self.nc, RX, CFG, on_payload=on_payload).start()

    def close(self) -> None:
        async def stop() -> None:
            await self.rx.close()
            await self.nc.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def test_in_flight_bytes_stay_under_the_receivers_credit_across_transfers(tight: TightServer) -> None:
    slow = SlowReceiver(tight.url, block_s=0.3)
    senders = [await nats.connect(tight.url) for _ in range(3)]
    try:
        payloads = {f"t{i}": make_payload(num_blocks=12, layers=8, seed=i) for i in range(12)}
        total = sum(p.nbytes for p in payloads.values())
        assert total > 16 * CFG.credit_bytes  # the bound is far below what moves
        txs = [NatsKVTransport(nc, None, CFG) for nc in senders]
        await asyncio.gather(*(txs[i % 3].send(p, RX, tid) for i, (tid, p) in enumerate(payloads.items())))
        assert set(slow.got) == set(payloads)
        assert all(slow.got[t].equal(p) for t, p in payloads.items())
        credits = slow.rx.credits
        assert credits.peak <= CFG.credit_bytes and slow.rx.pending_peak <= CFG.credit_bytes
        assert credits.peak >= CFG.credit_bytes // 2  # transfers did overlap: the bound was what held them
        assert credits.in_flight == 0 and credits.waiting == 0  # every grant came back
        assert tight.slow_consumers() == 0
    finally:
        for nc in senders:
            await nc.close()
        slow.close()


async def test_a_flood_without_credit_is_cut_off_by_the_same_server(tight: TightServer) -> None:
    """The control: the same slow receiver, sent bytes it did not grant, is a slow consumer."""
    slow = SlowReceiver(tight.url, block_s=3.0)
    nc = await nats.connect(tight.url)
    try:
        # A complete transfer blocks the receiver's loop for 3 s; meanwhile 48 MiB it never granted.
        blocker = asyncio.ensure_future(NatsKVTransport(nc, None, CFG).send(make_payload(num_blocks=1, layers=1), RX,
                                                                            "blocker"))
        while "blocker" not in slow.got:
            await asyncio.sleep(0.01)
        chunk = os.urandom(512 * KIB)
        for _ in range(96):
            await nc.publish(RX, chunk, headers={"Moebus-Kv-Id": "flood"})
        await nc.flush()
        deadline = time.monotonic() + 10
        while tight.slow_consumers() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert tight.slow_consumers() >= 1
        blocker.cancel()
    finally:
        await nc.close()
        slow.close()


DOOMED = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    r = await nc.request(sys.argv[2], b"", timeout=10, headers={"Moebus-Kv-Id": "doomed", "Moebus-Kv-Want": "1048576"})
    hdr = {"Moebus-Kv-Id": "doomed", "Moebus-Kv-Total": "64", "Moebus-Kv-Bytes": str(64 * 65536)}
    for seq in range(4):  # 4 of 64 chunks, a grant for 4 more, then nothing: it holds all the credit
        await nc.publish(sys.argv[2], b"x" * 65536, headers={**hdr, "Moebus-Kv-Seq": str(seq)})
    await nc.request(sys.argv[2], b"", timeout=10, headers={"Moebus-Kv-Id": "doomed", "Moebus-Kv-Want": "262144"})
    print(r.data.decode(), flush=True)
    await asyncio.sleep(3600)  # holds the credit until the test kills it
asyncio.run(main())
"""


async def test_a_sender_killed_mid_transfer_gives_its_credit_back_in_seconds(tight: TightServer) -> None:
    rxc, txc = await nats.connect(tight.url), await nats.connect(tight.url)
    rx = await NatsKVTransport(rxc, RX, CFG).start()
    proc = subprocess.Popen([sys.executable, "-c", DOOMED, tight.url, RX], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert '"grant": 1048576' in line
        assert rx.credits.in_flight == CFG.credit_bytes and "doomed" in rx.transfers()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        p = make_payload(num_blocks=8, layers=4, seed=3)  # more than the whole credit: needs the dead one's share
        await NatsKVTransport(txc, None, CFG).send(p, RX, "after")
        assert (await rx.receive("after", 5)).equal(p)
        took = time.monotonic() - killed
        assert CFG.chunk_idle_s * 0.5 < took < CFG.chunk_idle_s + 10  # it waited for the dead one's credit: ~1 s
        assert rx.credits.in_flight == 0 and rx.transfers() == []
    finally:
        if proc.poll() is None:
            proc.kill()
        await rx.close()
        await rxc.close()
        await txc.close()


async def test_credit_is_first_come_first_served_and_cancel_safe() -> None:
    c = ByteCredits(100)
    assert await c.acquire(60) == 60
    big = asyncio.ensure_future(c.acquire(80))  # waits for 80
    small = asyncio.ensure_future(c.acquire(10))  # would fit now, but queues behind the big one
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done() and c.waiting == 2
    c.release(60)
    assert await big == 80 and await small == 10 and c.in_flight == 90
    late = asyncio.ensure_future(c.acquire(50))
    await asyncio.sleep(0.01)
    late.cancel()
    await asyncio.sleep(0.01)
    assert c.waiting == 0 and c.in_flight == 90 and c.peak == 90
    c.release(90)
    assert await c.acquire(500) == 100 and c.free == 0  # clamped to the capacity
