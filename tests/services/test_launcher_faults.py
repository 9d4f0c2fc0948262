"""`moebus up` is a supervisor, not a tripwire (issue #23 item 4), through the real CLI with real
signals: SIGTERM during start-up stops everything cleanly; a SIGKILLed launcher (during start-up
or after) leaves no process behind; SIGKILLed children (nats-server, a worker, the tokenizer, the
frontend) come back while the others keep serving, and streams in flight end whole. Also a prompt
over the bus's max payload through the real stack: a 413 in OpenAI's error format (item 3)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.shared.nats_server import DEFAULT_MAX_PAYLOAD, free_port

from .test_launcher import until_healthy

CHAT = [{"role": "user", "content": "hi"}]


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live process below `pid`."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        kids.setdefault(pp, []).append(p)
    found, todo = {}, list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        if alive(p):
            found[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        todo += kids.get(p, [])
    return found


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def until_gone(pids, timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"


def pid_of(procs: dict[int, str], needle: str) -> int:
    [pid] = [p for p, cmd in procs.items() if needle in cmd]
    return pid


def up(*args: str, port: int, stderr: Path) -> subprocess.Popen:
    """`moebus up` on the toy model; its stderr (and its children's, without --log-dir) to a file: a
    pipe nobody reads would fill and block them."""
    with stderr.open("ab") as err:
        return subprocess.Popen([sys.executable, "-m", "moebus.cli", "up", "--model", "toy", "--port", str(port),
                                 "--host", "127.0.0.1", *args], stdout=subprocess.PIPE, stderr=err, text=True)


def test_sigterm_during_start_up_stops_everything(tmp_path) -> None:
    proc = up("--workers", "2", port=free_port(), stderr=tmp_path / "stderr")
    try:
        deadline = time.monotonic() + 60
        while len(kids := descendants(proc.pid)) < 3:  # nats-server and the first services are starting
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        print(f"\nSIGTERM during start-up ({len(kids)} children up): exited {proc.returncode} "
              f"after {time.monotonic() - t0:.2f}s")
        err = (tmp_path / "stderr").read_text()
        assert proc.returncode == 0, err[-2000:]
        assert "stopped during start-up" in err and "moebus up: http" not in out  # it never got to ready
        until_gone(kids, 5)  # stopped by the launcher itself, before it exited
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("when", ["start-up", "serving a 3-node NATS cluster"])
async def test_a_sigkilled_launcher_leaves_no_orphans(when: str, tmp_path) -> None:
    port = free_port()
    # local_render off: the prompt's text then crosses the bus to the tokenizer, whose limit item 3 checks
    # (rendered in the frontend it is refused as over the context length, a 400, before any bus)
    cluster = ["--nats-cluster", "3", "--frontend",
               json.dumps({"limits": {"max_body_bytes": 12 * 2**20}, "local_render": None})]
    proc = up("--workers", "2", *(cluster if "cluster" in when else []), port=port, stderr=tmp_path / "stderr")
    try:
        if when == "start-up":
            deadline = time.monotonic() + 60
            while len(descendants(proc.pid)) < 4:
                assert proc.poll() is None and time.monotonic() < deadline
                await asyncio.sleep(0.02)
        else:
            url = f"http://127.0.0.1:{port}"
            await until_healthy(url, proc)
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            r = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=3)
            assert r.choices[0].message.content == "Hel"
            await refuses_a_prompt_over_the_bus_limit(client)
        kids = descendants(proc.pid)
        if "cluster" in when:
            assert sum("nats-server" in cmd for cmd in kids.values()) == 3
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        until_gone(kids, 10)  # each killed by the kernel when its parent died (shared/lifeline.py)
        print(f"\nlauncher SIGKILLed during {when}: its {len(kids)} children gone after {time.monotonic() - t0:.2f}s")
    finally:
        if proc.poll() is None:
            proc.kill()


async def refuses_a_prompt_over_the_bus_limit(client: openai.AsyncOpenAI) -> None:
    """Item 3: a prompt over the bus's max payload (under the HTTP body limit) is refused with a
    413 before it is published, and the stack goes on serving."""
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "x" * (9 * 2**20)}])
    assert e.value.status_code == 413 and e.value.body["code"] == "payload_too_large"
    assert f"at most {DEFAULT_MAX_PAYLOAD}" in e.value.message
    r = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=2)
    assert r.choices[0].message.content == "He"


async def streams(client: openai.AsyncOpenAI, n: int, gaps: list[float] | None = None) -> list[asyncio.Task]:
    """n streams, each past its first characters when this returns; each one's longest wait between
    two chunks goes to `gaps` when it ends."""
    texts: list[list[str]] = [[] for _ in range(n)]

    async def one(out: list[str]) -> str:
        s = await client.chat.completions.create(model="toy", messages=CHAT, stream=True, max_tokens=200)
        times = []
        async for c in s:
            if c.choices and c.choices[0].delta.content:
                out.append(c.choices[0].delta.content)
                times.append(time.monotonic())
        if gaps is not None:
            gaps.append(max(b - a for a, b in zip(times, times[1:], strict=False)))
        return "".join(out)

    tasks = [asyncio.create_task(one(t)) for t in texts]
    deadline = time.monotonic() + 30
    while not all(len(t) >= 2 for t in texts):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks)
        await asyncio.sleep(0.02)
    return tasks


@pytest.mark.slow
async def test_up_restarts_what_dies_and_keeps_serving(tmp_path) -> None:
    port = free_port()
    proc = up("--workers", "2", "--heartbeat-interval", "0.2", "--engine", json.dumps({"step_delay_s": 0.05}),
              "--frontend", json.dumps({"limits": {"max_body_bytes": 12 * 2**20}, "local_render": None}),
              "--log-dir", str(tmp_path),
              port=port, stderr=tmp_path / "stderr")
    url = f"http://127.0.0.1:{port}"
    try:
        await until_healthy(url, proc)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        await refuses_a_prompt_over_the_bus_limit(client)
        for victim in ("nats-server", "--instance-id worker-0", "--instance-id tokenizer-0", "--instance-id frontend-0"):
            kids = descendants(proc.pid)
            pid = pid_of(kids, victim)
            gaps: list[float] = []
            tasks = await streams(client, 6, gaps)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            if victim.endswith("frontend-0"):  # its clients' connections go with it
                assert all(isinstance(r, openai.APIError) for r in await asyncio.gather(*tasks, return_exceptions=True))
            else:
                assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [TOY_REPLY] * 6, victim
            deadline = time.monotonic() + 60
            while (new := [p for p, cmd in descendants(proc.pid).items() if victim in cmd]) == []:
                assert proc.poll() is None and time.monotonic() < deadline, f"{victim} not restarted"
                await asyncio.sleep(0.1)
            assert new[0] != pid and proc.poll() is None
            await until_healthy(url, proc)
            r = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500)
            assert r.choices[0].message.content == TOY_REPLY
            print(f"\n{victim} SIGKILLed: restarted and serving again after {time.monotonic() - t0:.1f}s; longest "
                  f"pause of its 6 streams: {max(gaps, default=0):.2f}s (a token every 0.05 s)")
        if_nats = [cmd for cmd in descendants(proc.pid).values() if "nats-server" in cmd]
        assert len(if_nats) == 1 and "-p" in if_nats[0]
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode == 0
        until_gone(kids, 5)
    finally:
        if proc.poll() is None:
            proc.kill()
        async with aiohttp.ClientSession() as http:  # (nothing answers any more)
            with pytest.raises(aiohttp.ClientError):
                await http.get(url + "/health")
