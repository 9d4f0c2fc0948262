"""Bus auth on a real nats-server: strangers are refused, each role's user gets only its subjects.

nats-server refuses a publish or a subscription asynchronously (an -ERR to the client's error
callback); the Bus logs it and keeps it in `denied`, which these tests wait for. Each refusal is
also checked from the other side: an admin subscriber sees nothing arrive.
"""
from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import ADMIN, CREDS_ENV, BusUsers, Credentials, write_credentials
from moebus.shared.nats_server import NatsServer
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

S = Subjects()
USERS = BusUsers(S)
CREDS = {c.user: c for c in (USERS.add("frontend", "frontend-0"), USERS.add("tokenizer", "tokenizer-0"),
                              USERS.add("worker", "worker-0"), USERS.add("worker", "worker-1"), USERS.add(ADMIN))}


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer(jetstream=False, authorization=USERS.authorization()) as s:
        yield s


async def connect(url: str, creds: Credentials | None, tmp: Path, name: str = "test", **kw) -> Bus:
    path = None
    if creds is not None:
        path = str(write_credentials(tmp / f"{name}-{creds.user}.json", {name: creds}))
    return await Bus.connect(BusConfig(servers=[url], name=name, credentials=path, **kw), Tracing(name))


@pytest.fixture
async def buses(server: NatsServer, tmp_path: Path) -> AsyncIterator[dict[str, Bus]]:
    out = {i: await connect(server.url, c, tmp_path, name=i) for i, c in CREDS.items()}
    yield out
    for b in out.values():
        await b.drain()


async def refused(bus: Bus, subject: str, timeout: float = 5.0) -> None:
    """Until the server has refused `subject` to this bus (nats-py lower-cases the server's error)."""
    deadline = time.monotonic() + timeout
    while not any(f'"{subject.lower()}"' in d for d in bus.denied):
        assert time.monotonic() < deadline, f"no permissions violation for {subject}: {list(bus.denied)}"
        await asyncio.sleep(0.01)


async def watch(bus: Bus, subject: str) -> list[Msg]:
    got: list[Msg] = []

    async def cb(msg: Msg) -> None:
        got.append(msg)

    await bus.nc.subscribe(subject, cb=cb)
    await bus.flush()
    return got


async def nothing_but_a_marker(admin: Bus, seen: list[Msg], subject: str) -> None:
    """The admin's marker arrives at a subscriber of `subject`, and nothing arrived before it."""
    await admin.nc.publish(subject, b"marker")
    deadline = time.monotonic() + 5
    while not seen:
        assert time.monotonic() < deadline, f"the admin's marker did not arrive on {subject}"
        await asyncio.sleep(0.01)
    assert [m.data for m in seen] == [b"marker"], f"{subject} reached its subscribers"


async def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(server: NatsServer, tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(PermissionError):
        await connect(server.url, None, tmp_path)
    wrong = Credentials("frontend-0", "not-the-password")
    with pytest.raises(PermissionError, match="frontend-0"):
        await connect(server.url, wrong, tmp_path, name="frontend-0")
    assert time.monotonic() - started < 10, "refused credentials must fail fast, not retry forever"


async def test_frontend_cannot_take_worker_requests_drain_or_push_kv(buses: dict[str, Bus]) -> None:
    fe, admin = buses["frontend-0"], buses[ADMIN]
    generate = await watch(admin, S.worker_generate("worker-0"))

    async def steal(_: Empty, __: Msg) -> None:
        raise AssertionError("the frontend must not receive worker requests")

    await fe.subscribe(S.worker_generate("worker-0"), Empty, steal)
    await refused(fe, S.worker_generate("worker-0"))
    for subject in (S.drain("worker", "worker-0"), S.drain("tokenizer", "tokenizer-0"), S.kvtransfer_push("worker-0"),
                    S.worker_generate("worker-0")):
        seen = await watch(admin, subject)
        await fe.publish(subject, Empty())
        await refused(fe, subject)
        await nothing_but_a_marker(admin, seen, subject)
    assert [m.data for m in generate] == [b"marker"]  # and the frontend's subscription got nothing
    await fe.nc.subscribe("_INBOX.>")  # other users' replies
    await refused(fe, "_INBOX.>")


async def test_worker_cannot_send_another_worker_generate_work(buses: dict[str, Bus]) -> None:
    w0, w1 = buses["worker-0"], buses["worker-1"]
    got: list[str] = []

    async def on(_: Empty, msg: Msg) -> None:
        got.append(msg.subject)

    await w1.subscribe(S.worker_generate("worker-1"), Empty, on, concurrent=False)
    await w1.subscribe(S.worker_handoff("worker-1"), Empty, on, concurrent=False)
    await w1.flush()
    await w0.publish(S.worker_generate("worker-1"), Empty())
    await refused(w0, S.worker_generate("worker-1"))
    await w0.publish(S.worker_handoff("worker-1"), Empty())  # prefill -> decode is its job
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert got == [S.worker_handoff("worker-1")] and not w1.denied
    await w0.subscribe(S.worker_generate("worker-1"), Empty, on)  # nor read its requests
    await refused(w0, S.worker_generate("worker-1"))


async def test_request_reply_between_roles(buses: dict[str, Bus]) -> None:
    """A frontend asks the tokenizer: its inbox is its own, the tokenizer answers by allow_responses."""
    async def render(_: Empty, __: Msg) -> Empty:
        return Empty()

    await buses["tokenizer-0"].subscribe(S.tokenizer_render, Empty, render)
    await buses["tokenizer-0"].flush()
    assert await buses["frontend-0"].request(S.tokenizer_render, Empty(), Empty, timeout=5) == Empty()
    assert not buses["frontend-0"].denied and not buses["tokenizer-0"].denied


async def test_kv_broker_put_and_get_with_role_users(server: NatsServer, tmp_path: Path, monkeypatch) -> None:
    """Chunked KV transfers both ways: a worker puts blocks (the broker acks by allow_responses) and
    gets them back (the broker sends to the worker's own inbox)."""
    torch = pytest.importorskip("torch")
    from moebus.kv.block_client import KVBlockClient
    from moebus.kv.payload import KVBlock
    from moebus.services.kvbroker import KVBrokerConfig, KVBrokerService
    from moebus.shared.messages import KVEvent

    users = BusUsers(S)
    broker_file = write_credentials(tmp_path / "kvbroker-0.json", {"kvbroker-0": users.add("kvbroker", "kvbroker-0")})
    worker = users.add("worker", "worker-0")
    g = torch.Generator().manual_seed(0)
    blocks = [KVBlock([(torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)) for _ in range(2)])
              for _ in range(3)]
    with NatsServer(jetstream=False, authorization=users.authorization()) as srv:
        monkeypatch.setenv(CREDS_ENV, str(broker_file))  # as the launcher passes it to the broker process
        async with KVBrokerService(KVBrokerConfig(nats_url=srv.url, instance_id="kvbroker-0", chunk_bytes=1024)) as kb:
            bus = await connect(srv.url, worker, tmp_path, name="worker-0")
            events: list[KVEvent] = []
            seen = asyncio.Event()

            async def on_event(ev: KVEvent, _: Msg) -> None:
                events.append(ev)
                seen.set()

            try:  # the broker's events on what its tiers store reach the worker (kv_share's fetch reads them)
                await bus.subscribe(S.kvbroker_events, KVEvent, on_event)
                async with KVBlockClient(bus, "worker-0", chunk_bytes=1024) as w0:
                    assert await w0.put_blocks([1, 2, 3], blocks)
                    got = await w0.get_blocks([1, 2, 3])
                    assert len(got) == 3 and all(torch.equal(a.layers[0][0], b.layers[0][0])
                                                 for a, b in zip(got, blocks, strict=True))
                await asyncio.wait_for(seen.wait(), 5)
                assert [(e.holder, e.stored) for e in events] == [("kvbroker", [1, 2, 3])]
                assert not bus.denied and not kb.bus.denied
            finally:
                await bus.drain()


def make_cert(tmp: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return str(cert), str(key)


async def test_tls(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    with NatsServer(jetstream=False, authorization=USERS.authorization(), tls_cert=cert, tls_key=key) as server:
        assert server.url.startswith("tls://")
        bus = await connect(server.url, CREDS["frontend-0"], tmp_path, name="frontend-0", tls_ca=cert)
        try:
            assert bus.nc.connected_url is not None and bus.connected
        finally:
            await bus.drain()
        with pytest.raises(ssl.SSLCertVerificationError):  # not trusted without the CA: fails, fast
            await connect(server.url, CREDS["frontend-0"], tmp_path, name="frontend-0")
