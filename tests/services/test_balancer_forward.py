"""The balancer forwards an aggregated request to the worker as the frontend encoded it (no decode
and encode again on the way, issue 21 target 3): the worker gets the very bytes, fields this
balancer does not know included; the accept reply comes back as before."""
from __future__ import annotations

import time
import uuid

import orjson
from nats.aio.msg import Msg

from moebus.services.balancer import BalancerConfig, BalancerService
from moebus.shared.bus import Bus, BusConfig
from moebus.shared.messages import GenerateAccepted, GenerateRequest, Heartbeat, Load
from moebus.shared.subjects import Subjects
from moebus.shared.tracing import Tracing

from .conftest import wait_for


async def test_the_worker_gets_the_frontends_bytes(nats_server) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}.moebus.v1"
    s = Subjects(prefix)
    got: list[bytes] = []

    async def generate(req: GenerateRequest, msg: Msg) -> GenerateAccepted:
        got.append(msg.data)
        return GenerateAccepted(request_id=req.request_id, worker_id="w-0", attempt=req.attempt)

    bus = await Bus.connect(BusConfig(servers=[nats_server.url], name="test"), Tracing("test"))
    cfg = BalancerConfig(nats_url=nats_server.url, subject_prefix=prefix, heartbeat_interval_s=0.1, kv_aware=False)
    try:
        async with BalancerService(cfg) as bal:
            await bus.subscribe(s.worker_generate("w-0"), GenerateRequest, generate)
            await bus.publish(s.heartbeat("worker", "w-0"), Heartbeat(
                service="worker", instance_id="w-0", ts=time.time(), interval_s=60.0, model="m",
                load=Load(max_waiting=8)))
            await bus.flush()
            await wait_for(lambda: "w-0" in bal.table)
            req = GenerateRequest(request_id="r-1", model="m", prompt_token_ids=[5, 6, 7], reply_to="x.y", attempt=2)
            sent = orjson.dumps({**orjson.loads(req.encode()), "from_a_newer_frontend": [1, 2]})
            accepted = await bus.request(s.balancer_route, sent, GenerateAccepted, timeout=10)
            assert (accepted.worker_id, accepted.request_id, accepted.attempt) == ("w-0", "r-1", 2)
            assert got == [sent]
    finally:
        await bus.drain()
