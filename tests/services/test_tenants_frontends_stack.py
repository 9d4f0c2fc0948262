"""A tenant's limits hold across 2 frontends (issue 36 item 7), on `Stack` with `frontends=2` (real
processes, bus auth on): each frontend enforces 1/N of the tenant's token budget and rate, N from the
frontends' heartbeats (frontend/fleet/peers.py). Measured and printed: requests admitted at once when a
tenant worth L requests floods both (at most L: before, each frontend admitted L, 2L in all), its
rate over a window, and the trade-off (a flood reaching one frontend gets L/2; with the other
frontend dead, L again)."""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from moebus.services.frontend.admission.tenants import add_key
from moebus.services.frontend.config import TenantLimits
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.ports import free_port

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

L = 4  # the capped tenant's requests at once: its budget / one request's tokens
PROMPT, MAX_TOKENS = "hi", 60  # 2 prompt tokens: 62 tokens held per request
RATE, BURST = 4.0, 4


def _two_ports() -> int:
    """A free port whose next one is free too (frontend-0 and frontend-1)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
                 or line.startswith(name + "{")), 0.0)


async def _flood(http: aiohttp.ClientSession, urls: list[str], key: str, each: int) -> tuple[list[int], float]:
    """`each` streamed completions at every url at once: (admitted per url, most tokens in flight
    at once, all frontends' tenant gauges summed while they ran)."""
    async def one(url: str) -> int:
        body = {"model": "toy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        async with http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            async for _ in r.content:
                pass
            return r.status

    tasks = {url: [asyncio.create_task(one(url)) for _ in range(each)] for url in urls}
    peak = 0.0
    while not all(t.done() for ts in tasks.values() for t in ts):
        gauges = [await _metric(http, url, 'moebus_frontend_tenant_tokens_in_flight{tenant="capped"}')
                  for url in urls]
        peak = max(peak, sum(gauges))
        await asyncio.sleep(0.05)
    statuses = {url: [t.result() for t in ts] for url, ts in tasks.items()}
    assert all(s in (200, 429) for ss in statuses.values() for s in ss), statuses
    return [ss.count(200) for ss in statuses.values()], peak


async def _alive(http: aiohttp.ClientSession, url: str) -> float:
    return await _metric(http, url, "moebus_frontend_frontends_alive")


async def test_tenant_limits_hold_across_two_frontends(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    capped = add_key(keys, "capped", TenantLimits(max_tokens_in_flight=L * (2 + MAX_TOKENS)))
    paced = add_key(keys, "paced", TenantLimits(rate=RATE, burst=BURST))
    cfg = StackConfig(port=_two_ports(), host="127.0.0.1", model="toy", heartbeat_interval_s=0.2, frontends=2,
                      log_dir=str(tmp_path / "logs"), ready_timeout_s=60, frontend={"keys_file": str(keys)},
                      engine={"step_delay_s": 0.03})  # a request runs 60 steps: ~2 s
    with Stack(cfg) as stack:
        urls = stack.urls
        async with aiohttp.ClientSession() as http:
            counts = [0.0, 0.0]

            async def both_see_two() -> None:
                while counts != [2.0, 2.0]:
                    counts[:] = [await _alive(http, u) for u in urls]
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(both_see_two(), 10)

            # 1. a flood split over both frontends: L admitted in all (2L before: each admitted L)
            admitted, peak = await _flood(http, urls, capped, each=2 * L)
            print(f"\ncapped tenant, L={L}, {2 * L} requests at each of 2 frontends: admitted {admitted} "
                  f"(total {sum(admitted)}), peak tokens in flight {peak:g} of {L * (2 + MAX_TOKENS)}")
            assert sum(admitted) <= L and peak <= L * (2 + MAX_TOKENS)
            assert admitted == [L // 2, L // 2]  # each frontend its share, no less

            # 2. the rate over a window, asked alternately at both frontends
            ok = asked = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                async with http.get(urls[asked % 2] + "/v1/models",
                                    headers={"Authorization": f"Bearer {paced}"}) as r:
                    assert r.status in (200, 429)
                    ok += r.status == 200
                asked += 1
                await asyncio.sleep(0.02)  # a steady ask rate over the window
            window = time.monotonic() - t0
            bound = BURST + RATE * window
            print(f"paced tenant, rate {RATE:g}/s burst {BURST}: {ok} of {asked} admitted in {window:.2f}s over "
                  f"2 frontends (one frontend alone would allow {bound:.1f}; 2 unshared: {2 * bound:.1f})")
            assert ok <= bound + 2  # + one per frontend: its bucket's refill between our clock and its own

            # 3. the trade-off: a flood that reaches one frontend only gets that frontend's share
            admitted, _ = await _flood(http, urls[:1], capped, each=2 * L)
            print(f"capped tenant, {2 * L} requests at frontend-0 alone: admitted {admitted[0]} (its share, L/2)")
            assert admitted == [L // 2]

            # 4. frontend-1 dies: frontend-0 takes the whole limit once its beats are missed (3 intervals)
            stack.kill("frontend-1")
            t_kill = time.monotonic()
            while await _alive(http, urls[0]) != 1.0:
                assert time.monotonic() - t_kill < 5, "frontend-0 still counts frontend-1"
                await asyncio.sleep(0.05)
            print(f"frontend-1 killed: frontend-0 alone after {time.monotonic() - t_kill:.2f}s")
            admitted, _ = await _flood(http, urls[:1], capped, each=2 * L)
            print(f"capped tenant, {2 * L} requests at frontend-0, the only frontend: admitted {admitted[0]}")
            assert admitted == [L]

