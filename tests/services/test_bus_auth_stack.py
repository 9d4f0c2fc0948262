"""`Stack` (moebus up) with bus auth on, as it is by default: it serves, every process has its own
user by a private credentials file, and no password shows on a command line or in a log."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import CREDS_ENV, TLS_CA_ENV
from moebus.shared.nats_server import free_port
from moebus.shared.service import Empty
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .test_bus_auth import make_cert, refused

CHAT = [{"role": "user", "content": "hi"}]


def toy(tmp_path: Path, **kw) -> StackConfig:
    return StackConfig(port=free_port(), host="127.0.0.1", model="toy", heartbeat_interval_s=0.2,
                       log_dir=str(tmp_path / "logs"), ready_timeout_s=60, **kw)


async def chat(stack: Stack) -> str:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=15)
    stream = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


async def test_stack_serves_with_auth_and_keeps_passwords_off_argv_and_logs(tmp_path: Path) -> None:
    with Stack(toy(tmp_path, workers=2)) as stack:
        assert stack.users is not None and "worker-1" in stack.users.users
        assert await chat(stack) == TOY_REPLY
        passwords = stack.users.passwords()
        pids = {i: p.pid for i, p in stack.procs.items()}
        nats_pid = stack.nats._proc.pid
        for pid in [*pids.values(), nats_pid]:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert not any(p in argv for p in passwords), f"a password on the command line of pid {pid}"
        creds = Path(environ(pids["worker-0"])[CREDS_ENV])
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600 and stat.S_IMODE(creds.parent.stat().st_mode) == 0o700
        assert list(json.loads(creds.read_text())) == ["worker-0"]  # its own user only

        with pytest.raises(PermissionError):  # a local process without credentials
            await Bus.connect(BusConfig(servers=[stack.services_url], name="stranger", credentials=None),
                              Tracing("t"))
        w0 = await Bus.connect(BusConfig(servers=[stack.services_url], name="worker-0", credentials=str(creds)),
                               Tracing("t"))
        try:  # with worker-0's own credentials: no generate work for worker-1
            await w0.publish(Subjects().worker_generate("worker-1"), Empty())
            await refused(w0, Subjects().worker_generate("worker-1"))
        finally:
            await w0.drain()
        # A process started later gets its user too (the server reloads its config)
        template = next(c for s, c in stack.service_configs() if c.instance_id == "worker-0")
        stack.spawn("worker", template.model_copy(update={"instance_id": "worker-9"}))
        await stack.wait_ready_async(60)
        assert "worker-9" in stack.users.users and await chat(stack) == TOY_REPLY
    assert not creds.exists(), "the credentials files outlive the stack"
    for log in (tmp_path / "logs").iterdir():
        text = log.read_text(errors="replace")
        assert not any(p in text for p in passwords), f"a password in {log.name}"


async def test_stack_with_tls(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path)
    with Stack(toy(tmp_path, nats_tls_cert=cert, nats_tls_key=key)) as stack:
        assert stack.services_url.startswith("tls://")
        assert environ(stack.procs["frontend-0"].pid)[TLS_CA_ENV] == cert
        assert await chat(stack) == TOY_REPLY


def test_auth_off_is_an_open_bus(tmp_path: Path) -> None:
    stack = Stack(toy(tmp_path, nats_auth=False))
    try:
        stack.start()
        assert stack.users is None and stack.nats_url == stack.services_url
        assert CREDS_ENV not in environ(stack.procs["tokenizer-0"].pid) or os.environ.get(CREDS_ENV)
    finally:
        stack.stop()
