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
import pytest

from moebus.services.launcher import Stack, StackConfig
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
        for pid in procs:  # --api-key is on the launcher's command line (it warns), never on a child's
            for what in ("cmdline", "environ"):
                assert b"sk-1" not in open(f"/proc/{pid}/{what}", "rb").read(), (pid, what)
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


async def test_clean_sigterm_logs_nothing_above_info() -> None:
    """A WARNING is for an operator to look at: stopping a healthy stack must not log one."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moebus.cli", "up", "--model", "toy", "--port", str(port),
                             "--host", "127.0.0.1", "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        await until_healthy(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert " frontend INFO " in err and " worker INFO " in err, err  # the children's logs are in it
        loud = [line for line in err.splitlines() if any(f" {lv} " in line for lv in ("WARNING", "ERROR", "CRITICAL"))]
        assert loud == [], loud
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(("model", "opts", "encoders"), [
    ("smollm2", {}, 0),  # text only: no encoder process, images refused
    ("toy", {}, 0),
    ("vlm", {}, 1),  # a vision-language checkpoint (config.json with a vision_config)
    ("smollm2", {"encoders": 1}, 1),  # asked for: the ImageNet classifier speaks through SmolLM2
    ("smollm2", {"encoder": {"encoder": "mmproj.gguf"}}, 1),  # an image encoder named
    ("vlm", {"encoders": 0}, 0),
])
def test_an_encoder_only_for_a_model_that_takes_images(tmp_path, model: str, opts: dict, encoders: int) -> None:
    if model == "vlm":
        model = str(tmp_path)
        (tmp_path / "config.json").write_text('{"architectures": ["Idefics3ForConditionalGeneration"], '
                                              '"vision_config": {"hidden_size": 768}, "text_config": {}}')
    configs = Stack(StackConfig(model=model, **opts)).service_configs()
    assert [c.instance_id for s, c in configs if s == "encoder"] == [f"encoder-{i}" for i in range(encoders)]
    assert all(c.accept_images == (encoders > 0) for s, c in configs if s == "frontend")


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


async def _probe(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> tuple[int, dict]:
    """(status, JSON body) of GET url; (0, {}) while nothing listens yet."""
    assert proc.poll() is None, "the frontend exited"
    try:
        async with http.get(url) as r:
            return r.status, await r.json()
    except aiohttp.ClientConnectionError:
        return 0, {}


async def test_frontend_ready_only_once_a_worker_serves_its_model() -> None:
    """Real processes, as deploy/frontend.yaml probes them: /health (liveness) is 200 as soon as the
    frontend is up; /ready (readiness) is 503 with an OpenAI-style error until a worker serves the model."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "moebus.cli", "serve"]
    with NatsServer() as nats:
        common = ["--nats-url", nats.url, "--heartbeat-interval-s", "0.2"]
        frontend = subprocess.Popen([*cli, "frontend", *common, "--host", "127.0.0.1", "--port", str(port),
                                     "--models", "toy"], stderr=subprocess.DEVNULL)
        worker = None
        try:
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 30
                while (await _probe(http, url + "/health", frontend))[0] != 200:
                    assert time.monotonic() < deadline, "frontend not alive in time"
                    await asyncio.sleep(0.1)
                status, body = await _probe(http, url + "/ready", frontend)
                assert status == 503 and body["models_without_workers"] == ["toy"]
                assert body["error"]["message"] == "no ready worker serves 'toy'"
                assert body["error"]["type"] == "service_unavailable"
                worker = subprocess.Popen([*cli, "worker", *common, "--model", "toy", "--instance-id", "worker-r"],
                                          stderr=subprocess.DEVNULL)
                deadline = time.monotonic() + 60
                while (ready := await _probe(http, url + "/ready", frontend))[0] != 200:
                    assert ready[0] == 503 and worker.poll() is None, ready
                    assert time.monotonic() < deadline, "never ready"
                    await asyncio.sleep(0.1)
                assert ready[1]["workers"] == {"toy": ["worker-r"]} and "error" not in ready[1]
        finally:
            for proc in (worker, frontend):
                if proc is not None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
