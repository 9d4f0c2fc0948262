"""NATS connection wrapper: typed publish/request/subscribe with trace headers and typed errors.

Every publish and request carries the current W3C trace context; every handler runs inside a span
parented on the sender's. Handlers return a Message (sent as the reply) or raise ServiceError
(sent as error headers). nats-py runs one subscription's callbacks one at a time, so handlers that
await other services are spawned as tasks (`concurrent=True`) to keep one slow request from
blocking the subject. A message over the server's max payload (headers included) is refused
here as ServiceError(PAYLOAD_TOO_LARGE), never handed to nats-py (MaxPayloadError, or the server
closing the connection); a handler whose reply is too large answers with that error instead.

Credentials (shared.bus_auth) come from the file $MOEBUS_NATS_CREDS names, or the server URL;
$MOEBUS_NATS_TLS_CA is the certificate a TLS server is checked against. The server refuses what a
user may not publish or subscribe asynchronously, with an error the Bus logs and keeps (`denied`).

Blips: nats-py reconnects by itself (forever, by default) and re-subscribes. The Bus keeps when it
lost and regained the server and tells watchers (`watch`); `evidence_since` says from when the
silence of a peer counts against it, so a service that was cut off itself does not declare others
dead for the beats it could not hear (they were cut off too, and reconnect within about
`reconnect_time_wait_s` of it). A request in flight when the connection drops may never be
answered (the server went down with it or its reply), and nats-py would wait out its whole
timeout (a frontend's detokenize call: 10 s of a stream's silence after a 1 s blip); an
idempotent one is asked again at once instead (sent when the connection is back).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from typing import TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, Field, ValidationError

from .bus_auth import CREDS_ENV, TLS_CA_ENV, load_credentials
from .codec import Message
from .errors import ErrorCode, NoResponders, RequestTimeout, ServiceError
from .metrics import Metrics
from .tracing import Tracing

log = logging.getLogger(__name__)
PING_PATIENCE_S = 24 * 3600.0  # nats-py's own flush timeout: never reached (Bus._round_trip)
M = TypeVar("M", bound=Message)
Handler = Callable[[M, Msg], Awaitable[Message | None]]


class BusConfig(BaseModel):
    servers: list[str] = ["nats://127.0.0.1:4222"]
    name: str = "moebus"
    connect_timeout_s: int = 5
    reconnect_time_wait_s: float = 0.5
    max_reconnect_attempts: int = -1  # forever: a NATS restart must not kill our services
    ping_interval_s: int = 10
    drain_timeout_s: int = 10
    # After a reconnect, how long before the silence of peers counts against them again: peers cut
    # off with us come back within about one reconnect_time_wait_s of us (see Bus.evidence_since).
    settle_s: float = Field(2.0, ge=0)
    # A credentials file (shared.bus_auth): the entry for `name`, else its "*" entry. None: no user
    # (or the one in the server URL).
    credentials: str | None = Field(default_factory=lambda: os.environ.get(CREDS_ENV) or None)
    tls_ca: str | None = Field(default_factory=lambda: os.environ.get(TLS_CA_ENV) or None)


class Bus:
    def __init__(self, nc: NATS, tracing: Tracing, metrics: Metrics | None = None, settle_s: float = 2.0) -> None:
        self.nc = nc
        self.tracing = tracing
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        self.denied: deque[str] = deque(maxlen=100)  # the server's recent permission refusals
        self.settle_s = settle_s
        self.disconnected_at: float | None = None  # monotonic; None while connected
        self.reconnected_at: float | None = None  # the latest reconnect (monotonic)
        self.outages = 0  # disconnects so far
        self._watchers: list[Callable[[bool], None]] = []
        self._state = "up"  # up, down (reconnecting) or closed: watchers hear of each change once
        self._in_flight: set[asyncio.Timeout] = set()  # idempotent requests awaiting a reply: a drop cuts them
        self._ping: asyncio.Future | None = None  # the PING out for flush() (at most one: see _round_trip)

    @classmethod
    async def connect(cls, cfg: BusConfig, tracing: Tracing, metrics: Metrics | None = None) -> Bus:
        """Raises PermissionError when the server refuses the credentials, ssl.SSLCertVerificationError
        when its certificate is not trusted (no retrying: neither heals by itself)."""
        bus: Bus | None = None
        refused: list[Exception] = []
        refusal = asyncio.Event()

        async def on_error(e: Exception) -> None:
            text = str(e).lower()
            if "permissions violation" in text:  # the server dropped that publish or subscription
                log.error("nats refused %s a subject its bus user may not use (shared.bus_auth): %s", cfg.name, e)
                if bus is not None:
                    bus.denied.append(str(e))
                return
            if bus is None and ("authorization violation" in text or isinstance(e, ssl.SSLCertVerificationError)):
                refused.append(e)
                refusal.set()
            quiet = bus is not None and (bus.closing or (bus.disconnected_at is not None and isinstance(e, OSError)))
            log.log(logging.INFO if quiet else logging.WARNING, "nats error (%s): %s", cfg.name, e)  # (each retry)

        async def on_disconnect() -> None:
            log.log(logging.INFO if bus and bus.closing else logging.WARNING, "nats disconnected (%s)", cfg.name)
            if bus is not None:
                bus._changed(False)

        async def on_reconnect() -> None:
            if bus is not None:
                log.warning("nats reconnected (%s) after %.1fs", cfg.name, bus.down_for())
                bus._changed(True)

        async def on_closed() -> None:
            if bus is not None and not bus.closing:
                log.error("nats connection closed for good (%s): reconnect attempts exhausted", cfg.name)
                bus._changed(False)

        auth: dict = {}
        if cfg.credentials:
            creds = load_credentials(cfg.credentials, cfg.name)
            auth = {"user": creds.user, "password": creds.password, "inbox_prefix": creds.inbox}
        if cfg.tls_ca:
            auth["tls"] = ssl.create_default_context(cafile=cfg.tls_ca)
        connecting = asyncio.ensure_future(nats.connect(
            cfg.servers, name=cfg.name, connect_timeout=cfg.connect_timeout_s,
            reconnect_time_wait=cfg.reconnect_time_wait_s, max_reconnect_attempts=cfg.max_reconnect_attempts,
            ping_interval=cfg.ping_interval_s, drain_timeout=cfg.drain_timeout_s,
            error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, closed_cb=on_closed,
            **auth,
        ))
        watch = asyncio.ensure_future(refusal.wait())
        try:
            await asyncio.wait((connecting, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if refused or not connecting.done():  # refused, or we were cancelled: stop trying
                connecting.cancel()
        if refused:
            if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
                await connecting.result().close()
            if isinstance(refused[0], ssl.SSLError):
                raise refused[0]
            raise PermissionError(f"nats refused the credentials of {cfg.name} "
                                  f"(${CREDS_ENV}: {cfg.credentials or 'not set'})") from refused[0]
        bus = cls(await connecting, tracing, metrics, cfg.settle_s)
        return bus

    # ---- connection state ------------------------------------------------------------------
    def watch(self, callback: Callable[[bool], None]) -> None:
        """callback(connected) on every disconnect (False), reconnect (True) and final close (False)."""
        self._watchers.append(callback)

    def _changed(self, connected: bool) -> None:
        now = time.monotonic()
        if connected:
            self.disconnected_at, self.reconnected_at = None, now
            if self._ping is not None:
                self._ping.cancel()  # its PONG went with the old connection
        elif self.disconnected_at is None:
            self.disconnected_at, self.outages = now, self.outages + 1
        state = "up" if connected else "closed" if self.nc.is_closed else "down"
        if not connected:
            for scope in self._in_flight:  # their replies will not come: ask again now
                scope.reschedule(-math.inf)
            self._in_flight.clear()
        if state == self._state:
            return
        self._state = state
        for callback in list(self._watchers):
            try:
                callback(connected)
            except Exception:
                log.exception("bus watcher failed")

    @property
    def evidence_since(self) -> float:
        """Monotonic time from which a peer's silence is evidence that it is gone: never while we
        are cut off ourselves (+inf), else not before `settle_s` after our latest reconnect."""
        if not self.nc.is_connected or self.disconnected_at is not None:  # (reconnected: not yet told)
            return math.inf
        return -math.inf if self.reconnected_at is None else self.reconnected_at + self.settle_s

    def down_for(self, now: float | None = None) -> float:
        """Seconds since the connection was lost (0 while connected; inf once closed for good)."""
        if self.nc.is_closed and not self.closing:
            return math.inf
        if self.disconnected_at is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.disconnected_at

    async def flush(self, timeout: float = 5.0) -> None:
        """Round trip to the server: every subscription made so far is live when this returns.
        Two round trips: nats-py (2.16) writes flush's PING to the socket at once, while a SUB
        just made waits in its buffer for the flusher task, so one PONG can come back before the
        server has the SUB (a request from another connection then got no-responders: a CI flake
        in test_bus_auth). The flusher runs while the first PING is out; the second follows the
        SUB on the wire."""
        await self._round_trip(timeout)
        await self._round_trip(timeout)

    async def _round_trip(self, timeout: float) -> None:
        """One PING/PONG. nats-py's own flush timeout cancels its PONG future but leaves it queued,
        and the PONG that comes late (a server paused, a machine frozen) then raises InvalidStateError
        in nats-py's read loop, which drops the connection. So nats-py's wait never times out here:
        ours does, on a shield, and the one PING out is reused until its PONG comes; a reconnect (nats-py
        forgets its PONGs then) cancels it."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(self.nc.flush(PING_PATIENCE_S))
        try:
            await asyncio.wait_for(asyncio.shield(self._ping), timeout)
        except TimeoutError:
            raise nats.errors.FlushTimeoutError from None

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def node(self) -> str | None:
        """The server we are connected to, "host:port" as its URL names it (None while down)."""
        url = self.nc.connected_url if self.nc.is_connected else None
        return None if url is None else f"{url.hostname}:{url.port or 4222}"

    def check_size(self, data: bytes, headers: dict[str, str] | None, what: str) -> None:
        """PAYLOAD_TOO_LARGE for a message the server would refuse (it counts headers too)."""
        limit = self.nc.max_payload
        size = len(data) + _headers_size(headers)
        if limit and size > limit:
            raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"{what} is {size} bytes; the bus carries at most {limit}")

    async def publish(self, subject: str, msg: Message | bytes, headers: dict[str, str] | None = None) -> None:
        """Raises ServiceError(PAYLOAD_TOO_LARGE) for a message over the server's max payload."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        headers = self.tracing.inject(headers)
        self.check_size(data, headers, f"{_kind(msg)} on {subject}")
        await self.nc.publish(subject, data, headers=headers)

    async def request(self, subject: str, msg: Message | bytes, reply_type: type[M], timeout: float,
                      headers: dict[str, str] | None = None, wait_for_responders_s: float = 0.0,
                      idempotent: bool = False, paused_wait_s: float = 0.0) -> M:
        """Request/reply; raises NoResponders, RequestTimeout, PAYLOAD_TOO_LARGE (a request over the
        server's max payload), or the ServiceError the handler raised. wait_for_responders_s: while
        nobody serves the subject (its service is restarting), ask again for this long; nobody got
        the request, so this is safe for any request. idempotent: a timeout is retried within that
        time too (a responder killed a moment ago may still be subscribed and swallow the request), and
        so is a request the connection dropped under (at once: its reply may never come); with no time
        left, that is a RequestTimeout. Others wait for their reply through a blip: it may still come.
        paused_wait_s: an idempotent request that times out is asked again for this long in all (a
        responder still subscribed but silent is paused, not gone: shared/liveness.py)."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        headers = self.tracing.inject(headers)
        self.check_size(data, headers, f"{_kind(msg)} on {subject}")
        started = time.monotonic()
        deadline, pause = started + wait_for_responders_s, 0.05
        paused_deadline = started + max(wait_for_responders_s, paused_wait_s)
        ask = self._ask_cuttable if idempotent else self.nc.request
        while True:
            try:
                reply = await ask(subject, data, timeout=timeout, headers=headers)
                if reply is None:  # the connection dropped under it
                    if time.monotonic() > deadline:
                        raise RequestTimeout(subject, _waited(started, timeout)) from None
                    continue
                break
            except nats.errors.NoRespondersError:
                if time.monotonic() + pause > deadline:
                    raise NoResponders(subject) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except nats.errors.TimeoutError:
                if not idempotent or time.monotonic() > paused_deadline:
                    raise RequestTimeout(subject, _waited(started, timeout)) from None
        err = ServiceError.from_headers(reply.headers)
        if err is not None:
            raise err
        return reply_type.decode(reply.data)

    async def _ask_cuttable(self, subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> Msg | None:
        """nats-py's request; None when the connection drops before the reply came."""
        scope = None
        try:
            async with asyncio.timeout(None) as scope:
                self._in_flight.add(scope)
                try:
                    return await self.nc.request(subject, data, timeout=timeout, headers=headers)
                finally:
                    self._in_flight.discard(scope)
        except TimeoutError:
            if scope is None or not scope.expired():
                raise  # nats-py's own timeout
            return None

    async def subscribe(self, subject: str, request_type: type[M], handler: Handler, *, queue: str = "",
                        concurrent: bool = True, endpoint: str | None = None, traced: bool = True) -> Subscription:
        """`traced=False` for high-volume streams (token chunks), where a span per message is noise."""
        name = endpoint or subject
        if self.metrics:  # both outcomes exported from the start: an error rate reads 0, not "no data"
            for outcome in ("ok", "error"):
                self.metrics.bus_messages.labels(name, outcome)

        async def run(msg: Msg) -> None:
            with self.tracing.consume(name, msg.headers) if traced else nullcontext():
                started, outcome = time.perf_counter(), "ok"
                try:
                    reply = await handler(request_type.decode(msg.data), msg)
                    if msg.reply and reply is not None:
                        data, headers = reply.encode(), self.tracing.inject()
                        self.check_size(data, headers, f"the {_kind(reply)} of {name}")  # an error reply instead
                        await self.nc.publish(msg.reply, data, headers=headers)
                except Exception as e:  # every failure becomes a typed reply, never a silent timeout
                    outcome = "error"
                    await self._reply_error(msg, _as_service_error(e, name))
                finally:
                    if self.metrics:
                        self.metrics.bus_messages.labels(name, outcome).inc()
                        self.metrics.bus_handler_seconds.labels(name).observe(time.perf_counter() - started)

        async def callback(msg: Msg) -> None:
            if not concurrent:
                await run(msg)
                return
            task = asyncio.create_task(run(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=callback)

    async def _reply_error(self, msg: Msg, err: ServiceError) -> None:
        if msg.reply and self.nc.is_connected:
            try:
                await self.nc.publish(msg.reply, b"", headers=self.tracing.inject(err.to_headers()))
            except Exception:  # connection going away: the caller will time out instead
                log.debug("could not send error reply", exc_info=True)

    async def drain(self, timeout: float = 10.0) -> None:
        """Let in-flight handlers finish (they may still publish), then drain and close."""
        self.closing = True
        if self.nc.is_closed:
            return
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        try:
            if self.nc.is_connected:  # draining needs the server; without it just close
                await self.nc.drain()
        except Exception:
            log.debug("drain failed", exc_info=True)
        for t in list(self._tasks):
            t.cancel()
        if self._ping is not None:
            self._ping.cancel()
        if not self.nc.is_closed:
            try:
                await self.nc.close()
            except OSError:  # closed mid-reconnect: nats-py flushes into a connection already gone
                log.debug("close failed", exc_info=True)


def _kind(msg: Message | bytes) -> str:
    return "a message" if isinstance(msg, bytes) else type(msg).__name__


def _headers_size(headers: dict[str, str] | None) -> int:
    """Bytes of the NATS/1.0 header block on the wire."""
    if not headers:
        return 0
    return 12 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


def _as_service_error(e: Exception, endpoint: str) -> ServiceError:
    if isinstance(e, ServiceError):
        return e
    if isinstance(e, ValidationError | ValueError):
        return ServiceError(ErrorCode.BAD_REQUEST, str(e))
    log.exception("handler %s failed", endpoint)
    return ServiceError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")


def _waited(started: float, timeout: float) -> float:
    """What a timeout error reports: the whole wait, asks again included (at least one ask's)."""
    return round(max(timeout, time.monotonic() - started), 1)
