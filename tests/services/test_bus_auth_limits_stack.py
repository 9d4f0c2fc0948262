"""Past the frontend, the bounds still hold (issue 36 item 7), on `Stack` (real processes, bus auth
on): with the frontend role's own credentials a `balancer.route` with n=64, a huge max_tokens or a
prompt longer than the context is refused with BAD_REQUEST naming the field, and so is each sent
straight to `worker.generate.<id>` with the balancer role's credentials; the worker runs none of
them. The bus has no API keys: the frontend role's credentials are the authority (shared/limits.py)."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from moebus.services.launcher import Stack
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import CREDS_ENV
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.messages import GenerateAccepted, GenerateRequest, SamplingOptions
from moebus.shared.service import Empty, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .test_bus_auth_stack import environ, toy

S = Subjects()
CONTEXT = 8192  # the limits' default max_model_len, which `moebus up` gives all three


async def _as(stack: Stack, instance: str) -> Bus:
    creds = environ(stack.procs[instance].pid)[CREDS_ENV]
    return await Bus.connect(BusConfig(servers=[stack.services_url], name=instance, credentials=creds),
                             Tracing("t"))


def _req(prompt: int = 3, **params) -> GenerateRequest:
    rid = f"gen-{uuid.uuid4().hex}"
    return GenerateRequest(request_id=rid, model="toy", prompt_token_ids=[104] * prompt,
                           params=SamplingOptions(**params), reply_to=S.frontend_stream("frontend-0", rid))


OVER = [("params.n", lambda: _req(n=64, max_tokens=4)),
        ("params.max_tokens", lambda: _req(max_tokens=10**9)),
        ("prompt_token_ids", lambda: _req(CONTEXT + 100, max_tokens=4))]


async def test_route_and_generate_recheck_the_frontends_bounds(tmp_path: Path) -> None:
    with Stack(toy(tmp_path)) as stack:
        fe, bal = await _as(stack, "frontend-0"), await _as(stack, "balancer-0")
        admin = await Bus.connect(stack.bus_config("observer"),
                                  Tracing("t"))
        try:
            for param, make in OVER:
                for who, bus, subject in (("frontend-0", fe, S.balancer_route),
                                          ("balancer-0", bal, S.worker_generate("worker-0"))):
                    with pytest.raises(ServiceError) as e:
                        await bus.request(subject, make(), GenerateAccepted, timeout=5)
                    print(f"{subject} as {who}: {e.value.code.value} param={e.value.param}: {e.value.message}")
                    assert e.value.code is ErrorCode.BAD_REQUEST and e.value.param == param, e.value
            ok = await fe.request(S.balancer_route, _req(max_tokens=2), GenerateAccepted, timeout=5)  # within: runs
            assert ok.worker_id == "worker-0"
            stats = await admin.request(S.stats("worker", "worker-0"), Empty(), Stats, timeout=5)
            assert stats.stats["accepted"] == 1, stats.stats  # the one within the bounds, none of the others
            bstats = await admin.request(S.stats("balancer", "balancer-0"), Empty(), Stats, timeout=5)
            assert sum(bstats.stats["picks"].values()) == 1
        finally:
            for b in (fe, bal, admin):
                await b.drain()
