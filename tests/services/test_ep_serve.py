"""`moebus serve worker --ep 2`: an expert-parallel worker group (2 ranks, attention DP) on a
tiny MoE checkpoint answers chat requests through the frontend."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.services.frontend import FrontendConfig, start_frontend
from moebus.services.tokenizer import TokenizerConfig, TokenizerService

from .conftest import wait_for
from .test_failover import migrations
from .test_migration_toy import Reader

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

pytest.importorskip("torch")
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from moebus.engine.distributed.tiny import write_tiny_moe_checkpoint

    path = write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe"), seed=0)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


@asynccontextmanager
async def control_plane(nats_url: str, model: str, prefix: str) -> AsyncIterator[tuple[BalancerService, int]]:
    """Tokenizer, balancer and frontend in this process for the tiny model: (balancer, HTTP port)."""
    common = {"nats_url": nats_url, "subject_prefix": prefix, "heartbeat_interval_s": 0.25}
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(TokenizerService(TokenizerConfig(model=model, served_model_name="tiny",
                                                                         **common)))
        bal = await stack.enter_async_context(BalancerService(BalancerConfig(**common)))
        runner, port = await start_frontend(FrontendConfig(host="127.0.0.1", port=0, models=["tiny"], **common))
        stack.push_async_callback(runner.cleanup)
        yield bal, port


def _worker(nats_url: str, model: str, prefix: str, instance: str, log, *extra: str, max_num_seqs: int = 8
            ) -> subprocess.Popen:
    engine = json.dumps({"num_kv_blocks": 64, "max_num_seqs": max_num_seqs, "max_model_len": 256})
    return subprocess.Popen([sys.executable, "-m", "moebus.cli", "serve", "worker", "--nats-url", nats_url,
                             "--model", model, "--served-model-name", "tiny", "--instance-id", instance,
                             "--subject-prefix", prefix, "--heartbeat-interval-s", "0.25", "--engine", engine,
                             "--torch-threads", "1", *extra], stdout=log, stderr=subprocess.STDOUT)


async def test_ep_worker_group_answers_chat(nats_server, moe_dir, tmp_path) -> None:
    from openai import AsyncOpenAI

    model, prefix = str(moe_dir), f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    log = open(tmp_path / "ep.log", "wb")  # noqa: SIM115
    proc = _worker(nats_server.url, model, prefix, "ep", log, "--ep", "2", max_num_seqs=4)
    try:
        async with control_plane(nats_server.url, model, prefix) as (bal, port):
            await wait_for(lambda: proc.poll() is None and len(bal.table.candidates("tiny", time.monotonic())) == 2,
                           timeout=120, interval=0.2)
            assert {e.worker_id for e in bal.table.candidates("tiny", time.monotonic())} == {"ep-ep0", "ep-ep1"}
            c = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            msgs = [{"role": "user", "content": "<5> <9> <13> <21>"}]
            rs = [await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True}) for _ in range(3)]
            assert all(r.usage.completion_tokens == 6 for r in rs)
            assert len({r.choices[0].message.content for r in rs}) == 1  # greedy: same answer on either rank
            assert set(bal.picks) == {"ep-ep0", "ep-ep1"}  # attention DP: both ranks took requests
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "ep.log").read_text()[-3000:])


async def test_a_group_losing_a_rank_hands_its_streams_over(nats_server, moe_dir, tmp_path) -> None:
    """SIGKILL one rank of a 2-rank group while streams run on it and on a plain worker: the dead
    rank's streams and the stalled survivor's move to the plain worker and finish whole, greedy
    text equal to the undisturbed run's."""
    import psutil
    from openai import AsyncOpenAI

    model, prefix = str(moe_dir), f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    log = open(tmp_path / "workers.log", "wb")  # noqa: SIM115
    group = _worker(nats_server.url, model, prefix, "ep", log, "--ep", "2")
    solo = _worker(nats_server.url, model, prefix, "solo", log)
    try:
        async with control_plane(nats_server.url, model, prefix) as (bal, port):
            await wait_for(lambda: len(bal.table.candidates("tiny", time.monotonic())) == 3, timeout=120,
                           interval=0.2)
            c = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

            async def stream(k: int) -> Reader:
                return Reader(await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"<5> <{k + 9}> <13>"}], max_tokens=240,
                    temperature=0, stream=True, extra_body={"ignore_eos": True, "min_tokens": 240}))

            undisturbed = await asyncio.gather(*(stream(k) for k in range(9)))
            reference = [s.text for s in await asyncio.gather(*(s.rest() for s in undisturbed))]
            opened = await asyncio.gather(*(stream(k) for k in range(9)))
            await asyncio.gather(*(s.first() for s in opened))  # all of them mid-stream
            ranks = [p for p in psutil.Process(group.pid).children(recursive=True)
                     if "multiprocessing" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]
            assert len(ranks) == 2
            ranks[1].kill()
            done = await asyncio.wait_for(asyncio.gather(*(s.rest() for s in opened)), 120)
            assert [s.text for s in done] == reference
            assert await migrations(f"http://127.0.0.1:{port}", "resumed") >= 1
    finally:
        for p in (group, solo):
            p.terminate()
        for p in (group, solo):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        print((tmp_path / "workers.log").read_text()[-4000:])
