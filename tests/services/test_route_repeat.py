"""A route asked again (the frontend heard nothing within route_attempt_s) loses no request and runs
none twice: a balancer killed holding the ask (its replacement routes the repeat; the worker the dead
one reached is told to stop), a slow route (the repeat waits for it), and the memo itself."""
from __future__ import annotations

import asyncio
import re
import time

import pytest
from openai import AsyncOpenAI

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.balancer.route_memo import RouteMemo
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateAccepted

from .conftest import toy_stack, wait_for

CHAT = [{"role": "user", "content": "hi"}]


def accepted(worker: str) -> GenerateAccepted:
    return GenerateAccepted(request_id="r", worker_id=worker, attempt=0)


async def test_the_memo_answers_repeats_with_the_first_route() -> None:
    calls: list[str] = []
    repeats: list[int] = []
    gate = asyncio.Event()

    async def route() -> GenerateAccepted:
        calls.append("route")
        await gate.wait()
        return accepted(f"w{len(calls)}")

    memo = RouteMemo(keep_s=60, on_repeat=lambda: repeats.append(1))
    first = asyncio.create_task(memo.once(("r", 0), route))
    await asyncio.sleep(0)
    second = asyncio.create_task(memo.once(("r", 0), route))  # while the first routes
    await asyncio.sleep(0)
    gate.set()
    assert (await first).worker_id == (await second).worker_id == "w1"
    assert (await memo.once(("r", 0), route)).worker_id == "w1"  # after it answered
    assert (await memo.once(("r", 1), route)).worker_id == "w2"  # another attempt routes anew
    assert len(calls) == 2 and len(repeats) == 2


async def test_the_memo_forgets_failed_and_expired_routes() -> None:
    calls = 0

    async def route() -> GenerateAccepted:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ServiceError(ErrorCode.UNAVAILABLE, "no worker")
        return accepted(f"w{calls}")

    memo = RouteMemo(keep_s=0.05)
    with pytest.raises(ServiceError):
        await memo.once(("r", 0), route)
    assert (await memo.once(("r", 0), route)).worker_id == "w2"  # the failure was not kept
    await asyncio.sleep(0.1)
    assert (await memo.once(("r", 0), route)).worker_id == "w3"  # nor the answer, past keep_s


async def test_a_repeat_waits_for_a_route_in_flight_and_shares_its_error() -> None:
    gate = asyncio.Event()

    async def route() -> GenerateAccepted:
        await gate.wait()
        raise ServiceError(ErrorCode.OVERLOADED, "full")

    memo = RouteMemo(keep_s=60)
    asks = [asyncio.create_task(memo.once(("r", 0), route)) for _ in range(2)]
    await asyncio.sleep(0)
    gate.set()
    for a in asks:
        with pytest.raises(ServiceError, match="full"):
            await a


async def test_a_balancer_killed_holding_the_route_loses_nothing_and_the_orphan_stops(nats_server) -> None:
    """The first ask reaches a worker through a balancer that then dies without answering (its memo
    dies with it); the frontend asks again, the replacement routes to the other worker, and the
    first worker, streaming to a frontend that did not keep it, is told to stop."""
    async with toy_stack(nats_server.url, workers=2, engine={"step_delay_s": 0.05},
                         balancer={"policy": "round_robin"}, frontend={"route_attempt_s": 0.3}) as st:
        bal = st.balancer
        real, dead = bal._route, asyncio.Event()

        async def dies_holding_it(req, msg):
            bal._route = real  # the replacement process: its own code, an empty memo
            got = await real(req, msg)  # the worker took it...
            bal.memo = RouteMemo(bal.cfg.route_memo_s)
            await dead.wait()  # ...and no reply ever comes
            return got

        bal._route = dies_holding_it
        client = AsyncOpenAI(base_url=st.base_url + "/v1", api_key="none", max_retries=0)
        started = time.monotonic()
        reply = await asyncio.wait_for(client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200), 15)
        assert reply.choices[0].message.content == TOY_REPLY
        assert time.monotonic() - started < 0.3 + 60 * 0.05 + 5  # one repeat, not route_timeout_s
        assert sorted(w.request_counts.snapshot()["accepted"] for w in st.workers) == [1, 1]  # both took it

        def outcomes() -> list[tuple[int, int]]:
            return sorted((c["finished"], c["aborted"]) for c in (w.request_counts.snapshot() for w in st.workers))

        await wait_for(lambda: outcomes() == [(0, 1), (1, 0)], timeout=5)  # the orphan stopped, not finished
        assert all(w.stats()["active_requests"] == 0 for w in st.workers)
        dead.set()


async def test_a_slow_route_asked_again_runs_once(nats_server) -> None:
    """The route takes longer than route_attempt_s (the frontend asks again twice): the repeats wait
    for it and get its answer; one worker runs the request, the other never sees it."""
    async with toy_stack(nats_server.url, workers=2, balancer={"policy": "round_robin"},
                         frontend={"route_attempt_s": 0.2}) as st:
        bal = st.balancer
        real = bal._route

        async def slow(req, msg):
            got = await real(req, msg)
            await asyncio.sleep(0.5)  # a slow answer: the frontend's attempt (0.2 s) asks again
            return got

        bal._route = slow
        client = AsyncOpenAI(base_url=st.base_url + "/v1", api_key="none", max_retries=0)
        reply = await asyncio.wait_for(client.chat.completions.create(model="toy", messages=CHAT, max_tokens=200), 15)
        assert reply.choices[0].message.content == TOY_REPLY
        assert sorted(w.request_counts.snapshot()["accepted"] for w in st.workers) == [0, 1]
        assert sorted(w.request_counts.snapshot()["aborted"] for w in st.workers) == [0, 0]
        assert routed(bal, "repeat") >= 1


def routed(bal, outcome: str) -> float:
    text = bal.metrics.render().decode()
    return float(re.search(rf'^moebus_balancer_routed_total{{outcome="{outcome}"}} (\S+)$', text, re.M)[1])
