"""KV transfer over NATS: the payload's encoding in ordered chunks, reassembled by transfer id,
under credit-based flow control sized to the receiver.

Flow control (credit.py): before putting chunks on the wire the sender asks the receiver for a
grant (a request with no body, headers H_ID + H_WANT bytes, at most `grant_bytes`); the
receiver answers once its one pool, shared by all transfers to it, has that much free, and
returns a chunk's bytes to the pool as soon as the chunk is stored. The bytes in flight to a
receiver are so bounded by `credit_bytes` across all concurrent transfers (not per transfer),
and its subscription's pending limits are sized above that: nats-server's per-connection
MaxPending (64 MiB) is never approached, so KV can never make the receiver a slow consumer. A
chunk beyond its transfer's credit fails that transfer. The last chunk is a request the
receiver acks after checking the CRC-32 of the whole encoding (and running `on_payload`).

Lost senders: a transfer that holds credit but sends nothing for `chunk_idle_s` is dropped
and its credit returned (a SIGKILLed sender stalls no other transfer for long); a sender
waits at most `grant_timeout_s` for a grant and `ack_timeout_s` for the final ack. Give the
transport its own NATS connection (WorkerKVLink does), so bulk bytes never queue with control
traffic (heartbeats, token chunks) on one socket.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from moebus.kv.payload import KVPayload
from moebus.kv.transports.credit import ByteCredits
from moebus.kv.transports.transport import KVTransferError, KVTransferTimeout, KVTransport

log = logging.getLogger(__name__)
H_ID, H_SEQ, H_TOTAL, H_BYTES, H_CRC, H_WANT = ("Moebus-Kv-Id", "Moebus-Kv-Seq", "Moebus-Kv-Total", "Moebus-Kv-Bytes",
                                                "Moebus-Kv-Crc", "Moebus-Kv-Want")
MIB = 1024 * 1024


@dataclass(slots=True)
class NatsTransportConfig:
    chunk_bytes: int = 512 * 1024  # capped by the server's max_payload
    grant_bytes: int = 4 * MIB  # sender: the most asked for in one grant (one round trip per grant)
    credit_bytes: int = 16 * MIB  # receiver: bytes in flight to it, all transfers together
    grant_timeout_s: float = 30.0  # sender: no grant this long (receiver gone or swamped): fail
    ack_timeout_s: float = 10.0  # sender: the final chunk's ack
    chunk_idle_s: float = 5.0  # receiver: a transfer holding credit with no chunk this long is dropped
    ttl_s: float = 60.0  # receiver: partial or unclaimed transfers are dropped after this

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1024 or self.grant_bytes < self.chunk_bytes or self.credit_bytes < self.grant_bytes:
            raise ValueError("need 1024 <= chunk_bytes <= grant_bytes <= credit_bytes")

    @property
    def pending_bytes_limit(self) -> int:
        """The receiving subscription's buffer: credit plus room for grant requests and acks."""
        return 2 * self.credit_bytes + 4 * MIB


@dataclass(slots=True)
class _Assembly:
    started: float
    total: int = 0
    nbytes: int = 0
    credit: int = 0  # granted and not yet arrived
    last: float = 0.0  # the latest chunk or grant
    parts: dict[int, bytes] = field(default_factory=dict)
    crc: int | None = None
    error: str = ""


@dataclass(slots=True)
class _Done:
    at: float
    payload: KVPayload | None = None
    error: str = ""


class NatsKVTransport(KVTransport):
    """`subject` is this endpoint's receive address (e.g. ``moebus.v1.kvtransfer.push.<worker>``);
    a send-only endpoint may pass None. With `on_payload`, every completed transfer is handed to
    it (awaited before the final ack, so a returned send means it was handled) instead of
    waiting for receive()."""

    def __init__(self, nc: NATS, subject: str | None, config: NatsTransportConfig | None = None,
                 on_payload: Callable[[str, KVPayload], Awaitable[None]] | None = None) -> None:
        self.nc, self.subject = nc, subject
        self.config = config or NatsTransportConfig()
        self.on_payload = on_payload
        self.credits = ByteCredits(self.config.credit_bytes)
        self.pending_peak = 0  # the most chunk bytes seen queued in the subscription (incl. the one at hand)
        self._sub: Subscription | None = None
        self._partial: dict[str, _Assembly] = {}
        self._done: dict[str, _Done] = {}
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._granting: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None

    @property
    def address(self) -> str:
        if self.subject is None:
            raise RuntimeError("a send-only transport has no address")
        return self.subject

    async def start(self) -> Self:
        if self.subject is not None and self._sub is None:
            self._sub = await self.nc.subscribe(self.subject, cb=self._on_message,
                                                pending_bytes_limit=self.config.pending_bytes_limit)
            await self.nc.flush()
            await self.nc.flush()  # twice: the first PING can overtake the SUB (shared/bus.py, Bus.flush)
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return self

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for t in (self._reaper, *self._granting):
            if t is not None:
                t.cancel()
        for fut in self._waiters.values():
            fut.cancel()

    # --- sender ----------------------------------------------------------------------------
    def chunk_size(self) -> int:
        return max(1024, min(self.config.chunk_bytes, self.nc.max_payload - 4096))

    async def send(self, payload: KVPayload, dest: str, transfer_id: str) -> None:
        await self.send_bytes(payload.to_bytes(), dest, transfer_id)

    async def send_bytes(self, body: bytes | bytearray, dest: str, transfer_id: str) -> None:
        cfg, mv = self.config, memoryview(body)
        # The first grant names the receiver's whole credit: no chunk may be larger.
        credit, capacity = await self._grant(dest, transfer_id, max(1, min(cfg.grant_bytes, len(mv))))
        size = min(self.chunk_size(), capacity)
        total = max(1, -(-len(mv) // size))
        base = {H_ID: transfer_id, H_TOTAL: str(total), H_BYTES: str(len(mv))}
        asked = credit  # bytes granted or asked for so far
        ahead: asyncio.Task[tuple[int, int]] | None = None  # the next grant, asked while this one is spent
        try:
            for seq in range(total):
                data = bytes(mv[seq * size:(seq + 1) * size])
                if ahead is None and asked < len(mv):
                    want = max(size, min(cfg.grant_bytes, len(mv) - asked))
                    ahead, asked = asyncio.ensure_future(self._grant(dest, transfer_id, want)), asked + want
                while credit < len(data):
                    if ahead is None:  # (a grant smaller than asked: ask again)
                        ahead = asyncio.ensure_future(self._grant(dest, transfer_id, max(size, cfg.grant_bytes)))
                    credit += (await ahead)[0]
                    ahead = None
                credit -= len(data)
                hdr = {**base, H_SEQ: str(seq)}
                if seq < total - 1:
                    await self.nc.publish(dest, data, headers=hdr)
                    continue
                hdr[H_CRC] = str(zlib.crc32(mv))
                self._check(await self._request(dest, data, hdr, cfg.ack_timeout_s, f"no ack for chunk {seq}"),
                            transfer_id, f"chunk {seq}")
        finally:
            if ahead is not None:
                ahead.cancel()

    async def _grant(self, dest: str, transfer_id: str, want: int) -> tuple[int, int]:
        """(bytes granted, the receiver's whole credit)."""
        reply = await self._request(dest, b"", {H_ID: transfer_id, H_WANT: str(want)}, self.config.grant_timeout_s,
                                    f"no credit granted within {self.config.grant_timeout_s:g}s")
        ack = self._check(reply, transfer_id, "grant")
        return int(ack["grant"]), int(ack["capacity"])

    async def _request(self, dest: str, data: bytes, hdr: dict[str, str], timeout: float, what: str) -> Msg:
        try:
            return await self.nc.request(dest, data, timeout=timeout, headers=hdr)
        except nats.errors.NoRespondersError as e:
            raise KVTransferError(f"no KV receiver on {dest}") from e
        except (TimeoutError, nats.errors.TimeoutError) as e:
            raise KVTransferTimeout(f"{hdr[H_ID]}: {what} from {dest}") from e

    @staticmethod
    def _check(reply: Msg, transfer_id: str, what: str) -> dict:
        ack = json.loads(reply.data or b"{}")
        if not ack.get("ok"):
            raise KVTransferError(f"{transfer_id}: receiver refused {what}: {ack.get('error')}")
        return ack

    # --- receiver --------------------------------------------------------------------------
    async def receive(self, transfer_id: str, timeout: float = 30.0) -> KVPayload:
        if transfer_id not in self._done:
            fut = self._waiters.setdefault(transfer_id, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError as e:
                raise KVTransferTimeout(f"{transfer_id} did not arrive within {timeout}s") from e
            finally:
                self._waiters.pop(transfer_id, None)
        done = self._done.pop(transfer_id)
        if done.payload is None:
            raise KVTransferError(f"{transfer_id}: {done.error}")
        return done.payload

    async def _on_message(self, msg: Msg) -> None:
        h = msg.headers or {}
        tid = h.get(H_ID)
        if tid is not None and H_WANT in h:  # a grant may wait: never hold up the chunks behind it
            task = asyncio.get_running_loop().create_task(self._on_grant(msg, tid, int(h[H_WANT])))
            self._granting.add(task)
            task.add_done_callback(self._granting.discard)
            return
        self.pending_peak = max(self.pending_peak, len(msg.data) + (self._sub.pending_bytes if self._sub else 0))
        error = await self._on_chunk(msg, h, tid)
        if msg.reply:
            await msg.respond(json.dumps({"ok": not error, "error": error}).encode())

    async def _on_grant(self, msg: Msg, tid: str, want: int) -> None:
        if tid in self._done:
            await msg.respond(json.dumps({"ok": False, "error": "transfer already finished"}).encode())
            return
        now = time.monotonic()
        self._partial.setdefault(tid, _Assembly(now)).last = now
        n = await self.credits.acquire(want)
        asm = self._partial.get(tid)
        if asm is None or asm.error:  # dropped while it waited
            self.credits.release(n)
            return
        asm.credit += n
        asm.last = time.monotonic()
        await msg.respond(json.dumps({"ok": True, "grant": n, "capacity": self.credits.capacity}).encode())

    async def _on_chunk(self, msg: Msg, h: dict[str, str], tid: str | None) -> str:
        try:
            if tid is None:
                raise ValueError("chunk without a transfer id")
            seq, total, nbytes = int(h[H_SEQ]), int(h[H_TOTAL]), int(h[H_BYTES])
        except (KeyError, ValueError) as e:
            return f"bad chunk: {e}"
        if tid in self._done:
            return self._done[tid].error  # a duplicate of a finished transfer
        asm = self._partial.setdefault(tid, _Assembly(time.monotonic()))
        paid = min(asm.credit, len(msg.data))
        asm.credit -= paid
        self.credits.release(paid)
        asm.total, asm.nbytes, asm.last = total, nbytes, time.monotonic()
        if paid < len(msg.data):
            asm.error = asm.error or f"chunk {seq} sent beyond the transfer's credit"
        if asm.error:
            if msg.reply:  # the sender's last word: forget the transfer
                self._drop(tid)
            return asm.error
        asm.parts[seq] = msg.data
        if H_CRC in h:
            asm.crc = int(h[H_CRC])
        if asm.crc is not None and len(asm.parts) == asm.total:
            self._drop(tid)
            return await self._complete(tid, asm)
        if msg.reply:
            self._drop(tid)  # the sender gives up; a retry starts clean
            return f"missing chunks: have {len(asm.parts)} of {total}"
        return ""

    async def _complete(self, tid: str, asm: _Assembly) -> str:
        body = b"".join(asm.parts[i] for i in range(asm.total))
        done = _Done(time.monotonic())
        if len(body) != asm.nbytes or zlib.crc32(body) != asm.crc:
            done.error = "size or checksum mismatch"
        else:
            try:
                done.payload = KVPayload.from_bytes(body)
            except ValueError as e:
                done.error = f"undecodable payload: {e}"
        if self.on_payload is not None:
            if done.payload is not None:
                try:
                    await self.on_payload(tid, done.payload)
                except Exception as e:  # reported to the sender as a refused transfer
                    log.exception("KV payload handler failed for %s", tid)
                    done.error = f"handler failed: {e}"
            return done.error
        self._done[tid] = done
        fut = self._waiters.get(tid)
        if fut is not None and not fut.done():
            fut.set_result(None)
        return done.error

    def transfers(self) -> list[str]:
        """Transfers under way to this receiver (granted credit or partly arrived)."""
        return list(self._partial)

    def _drop(self, tid: str) -> None:
        asm = self._partial.pop(tid, None)
        if asm is not None:
            self.credits.release(asm.credit)
            asm.credit, asm.error = 0, asm.error or "dropped"

    async def _reap(self) -> None:
        interval = min(1.0, self.config.chunk_idle_s / 4)
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - before > 2 * interval or (self._sub is not None and self._sub.pending_msgs):
                # This receiver was behind (its loop stalled, or chunks wait in its queue): a
                # sender's silence until now may be its own doing, so it counts from now.
                for a in self._partial.values():
                    a.last = max(a.last, now)
                continue
            self.expire(now)

    def expire(self, now: float | None = None) -> None:
        """Drop transfers whose sender went quiet while holding credit (chunk_idle_s) or that are
        older than ttl_s, returning their credit; forget unclaimed results after ttl_s."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        for tid, a in list(self._partial.items()):
            if (a.credit and a.last < now - cfg.chunk_idle_s) or a.started < now - cfg.ttl_s:
                log.warning("dropping incomplete KV transfer %s (%d of %d chunks, sender silent for %.1fs)", tid,
                            len(a.parts), a.total, now - a.last)
                self._drop(tid)
        for tid in [t for t, d in self._done.items() if d.at < now - cfg.ttl_s and t not in self._waiters]:
            del self._done[tid]
