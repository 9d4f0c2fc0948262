"""Every abort ends its stream (issue 36 item 2), on `Stack` (real processes, bus auth on): a
`worker.abort` published by somebody other than the request's frontend (here with the frontend
role's credentials, as the issue's tester did), for a request that is decoding, one still queued
behind another, and by broadcast, ends the client's stream with an error event (or the
non-streamed call with an error status) within 1 s, and the worker is idle afterwards."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from moebus.services.launcher import Stack
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import CREDS_ENV
from moebus.shared.messages import AbortRequest, GenerateRequest
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import wait_for
from .test_bus_auth_stack import environ, toy

CHAT = [{"role": "user", "content": "hi"}]
BOUND_S = 1.0


@pytest.fixture
def stack(tmp_path: Path):
    # one sequence at a time, ~60 tokens at 0.05 s: a request runs ~3 s, a second one queues behind it
    with Stack(toy(tmp_path, engine={"step_delay_s": 0.05, "max_num_seqs": 1})) as s:
        yield s


async def _as_frontend(stack: Stack) -> Bus:
    creds = environ(stack.procs["frontend-0"].pid)[CREDS_ENV]
    return await Bus.connect(BusConfig(servers=[stack.services_url], name="frontend-0", credentials=creds),
                             Tracing("t"))


async def _watch_generates(stack: Stack) -> tuple[Bus, list[str]]:
    """The request ids the worker is sent (an admin observer beside the worker's own subscription)."""
    admin = await Bus.connect(BusConfig(servers=[stack.nats_url], name="observer"), Tracing("t"))
    seen: list[str] = []

    async def on(req: GenerateRequest, _) -> None:
        seen.append(req.request_id)

    await admin.subscribe(Subjects().worker_generate("worker-0"), GenerateRequest, on, traced=False)
    return admin, seen


async def _accepted(admin: Bus, n: int) -> bool:
    """Whether the worker has accepted n requests (asked over NATS)."""
    stats = await admin.request(Subjects().stats("worker", "worker-0"), Empty(), Stats, timeout=2)
    return stats.stats["accepted"] >= n


async def _ends_after_abort(stream, publish) -> tuple[float, Exception | None]:
    """Abort (by `publish`) once the stream has 3 chunks; how long until the stream ended, and how."""
    got, t_abort = 0, None
    try:
        async for _ in stream:
            got += 1
            if got == 3:
                t_abort = time.monotonic()
                await publish()
    except openai.APIError as e:
        return time.monotonic() - t_abort, e
    return time.monotonic() - (t_abort or time.monotonic()), None


async def test_abort_by_another_party_ends_the_stream(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=15)
    fe, (admin, seen) = await _as_frontend(stack), await _watch_generates(stack)
    try:
        # decoding: aborted on its worker's own subject
        stream = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500, stream=True)
        took, err = await asyncio.wait_for(_ends_after_abort(stream, lambda: fe.publish(
            Subjects().worker_abort("worker-0"), AbortRequest(request_id=seen[-1], reason="operator"))), 10)
        assert err is not None and "aborted" in str(err), err
        assert took < BOUND_S, f"the stream ended {took:.2f}s after the abort"

        # queued behind another request (nothing generated for it yet), non-streamed: an error status
        first = asyncio.create_task(client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500))
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500))
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        await wait_for(lambda: _accepted(admin, 3), timeout=10)  # accepted, waiting behind `first`
        t0 = time.monotonic()
        await fe.publish(Subjects().worker_abort_all, AbortRequest(request_id=seen[2], reason="operator"))
        with pytest.raises(openai.APIStatusError) as e:
            await asyncio.wait_for(queued, 10)
        took = time.monotonic() - t0
        assert e.value.status_code == 503 and e.value.body["code"] == "aborted", e.value.body
        assert took < BOUND_S, f"the queued request ended {took:.2f}s after the abort"
        assert not first.done(), "the abort of one request touched another"
        assert (await first).choices[0].finish_reason in ("stop", "length")
    finally:
        await fe.drain()
        await admin.drain()


async def test_an_abort_of_an_older_attempt_leaves_the_running_one(stack: Stack) -> None:
    """A frontend that moves a request on aborts the attempt it leaves, naming it; its new attempt can
    reach the same worker before that abort does (another way over the bus), and must go on."""
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=15)
    fe, (admin, seen) = await _as_frontend(stack), await _watch_generates(stack)
    try:
        stream = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=20, stream=True)
        # attempt 0 runs here; -1 stands for an attempt the frontend left (there is none before 0)
        _, err = await asyncio.wait_for(_ends_after_abort(stream, lambda: fe.publish(
            Subjects().worker_abort("worker-0"), AbortRequest(request_id=seen[-1], reason="migrated", attempt=-1))), 10)
        assert err is None, err

        stream = await client.chat.completions.create(model="toy", messages=CHAT, max_tokens=500, stream=True)
        _, err = await asyncio.wait_for(_ends_after_abort(stream, lambda: fe.publish(
            Subjects().worker_abort("worker-0"), AbortRequest(request_id=seen[-1], reason="migrated", attempt=0))), 10)
        assert err is not None and "aborted (migrated)" in str(err), err  # the running attempt's own abort
    finally:
        await fe.drain()
        await admin.drain()
