"""`moebus up` / `moebus serve` through the real CLI: start, serve a request, stop on signals."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import openai

from moebus.shared.nats_server import NatsServer, free_port


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


async def until_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the launcher exited"
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("stack not healthy in time")


async def test_up_serves_and_stops_everything_on_sigint() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "up", "--model", "toy", "--port", str(port),
                             "--host", "127.0.0.1", "--workers", "2", "--api-key", "sk-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        await until_healthy(url, proc)
        assert "moebus up" in proc.stdout.readline()
        procs = children(proc.pid)
        assert len(procs) == 6  # nats-server, tokenizer, balancer, 2 workers, frontend
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-1", max_retries=0)
        r = await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
        assert r.choices[0].message.content == "Hell"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        for pid in procs:  # nothing left behind
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_one_service_and_sigterm() -> None:
    with NatsServer() as nats:
        proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "serve", "balancer", "--nats-url", nats.url,
                                 "--instance-id", "balancer-x"], stderr=subprocess.PIPE, text=True)
        try:
            line = ""
            deadline = time.monotonic() + 20
            while "up (instance balancer-x)" not in line and time.monotonic() < deadline:
                line = proc.stderr.readline()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
