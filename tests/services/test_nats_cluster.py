"""A NATS cluster, for real (issue #23 item 5): three nats-server nodes on loopback with routes
between them and bus auth on; services spread over the nodes (each gets every URL); one node is
SIGKILLed under load: its clients move to the others and no stream is lost."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import nats
import openai
import pytest

from moebus.devmodel.toy import TOY_REPLY
from moebus.services.launcher import Stack, StackConfig
from moebus.shared.bus_auth import ADMIN, BusUsers
from moebus.shared.nats_cluster import NatsCluster
from moebus.shared.nats_server import ClusterRoutes, NatsServer, free_port

from .test_bus_blips import BOUND_S, ENGINE, STREAMS, metric, streams_under_blip, undisturbed


async def monitor(node: NatsServer, path: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{node.monitor_port}/{path}") as r:
        return json.loads(await r.text())


async def routes_of(node: NatsServer) -> set[str]:
    return {r["remote_name"] for r in (await monitor(node, "routez"))["routes"]}


async def until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_a_cluster_routes_messages_between_nodes_and_keeps_strangers_out() -> None:
    users = BusUsers()
    admin = users.add(ADMIN)
    with NatsCluster(3, authorization=users.authorization(), monitor=True) as cluster:
        nodes = cluster.nodes
        for node in nodes:  # a full mesh: each node routes to the other two
            await until(lambda n=node: _eq(routes_of(n), {m.cluster.server_name for m in nodes if m is not n}))
        creds = f"{admin.user}:{admin.password}@"
        a = await nats.connect(nodes[0].url.replace("://", f"://{creds}"))
        b = await nats.connect(nodes[2].url.replace("://", f"://{creds}"))
        try:
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_msg(m) -> None:
                got.put_nowait(m.data)

            await a.subscribe("t.cluster", cb=on_msg)
            await a.flush()

            async def delivered() -> bool:  # interest reaches node 2 over the route
                await b.publish("t.cluster", b"over the route")
                await asyncio.sleep(0.05)
                return not got.empty()

            await until(delivered)
            assert await got.get() == b"over the route"
            assert b.max_payload == a.max_payload == cluster.max_payload  # every node: deploy's max_payload
        finally:
            await a.close()
            await b.close()
        with pytest.raises(Exception, match="(?i)authorization"):  # client auth on every node
            await nats.connect(nodes[1].url, max_reconnect_attempts=0, allow_reconnect=False)
        # A server that knows the route port but not the routes' password does not join.
        routes = nodes[0].cluster
        stranger = ClusterRoutes(name=routes.name, server_name="stranger", port=free_port(), peers=(f"127.0.0.1:{routes.port}",),
                                 password="wrong")
        with NatsServer(jetstream=False, cluster=stranger, monitor_port=0) as s:
            await asyncio.sleep(1.5)  # several route attempts
            assert await routes_of(s) == set()
            assert "stranger" not in await routes_of(nodes[0])


async def _eq(got, want) -> bool:
    return await got == want


@pytest.fixture
def stack(tmp_path):
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="toy", workers=2, heartbeat_interval_s=0.2,
                      engine=ENGINE, max_queued=STREAMS, log_dir=str(tmp_path), ready_timeout_s=60,
                      nats_cluster=3, nats_monitor=True)
    with Stack(cfg) as s:
        yield s


async def placement(stack: Stack) -> dict[str, int]:
    """Instance id -> the node its connection is on (each running node's /connz)."""
    where = {}
    for i, node in enumerate(stack.bus_nodes.nodes):
        if node.poll() is not None:
            continue
        connz = await monitor(node, "connz")
        where |= {c["name"]: i for c in connz["connections"] if c.get("name") in stack.procs}
    return where


@pytest.mark.slow
async def test_a_killed_nats_node_loses_no_stream(stack: Stack) -> None:
    """SIGKILL the frontend's node under 20 streams; restart it (as the supervisor does); then SIGKILL
    a node holding a worker (not the frontend's)."""
    assert stack.users is not None and len(stack.nats_procs) == 3
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    baseline = await undisturbed(client)
    for fault in range(2):
        where = await placement(stack)
        assert set(where) == set(stack.procs)  # every service is connected somewhere
        if fault == 0:
            victim = where["frontend-0"]
        else:
            others = [n for i, n in where.items() if i.startswith("worker") and n != where["frontend-0"]]
            if not others:  # both workers share the frontend's node: take it again
                others = [where["frontend-0"]]
            victim = others[0]
        on_it = sorted(i for i, n in where.items() if n == victim)
        pid = stack.bus_nodes.nodes[victim]._proc.pid

        async def kill(_: float, pid: int = pid) -> None:
            os.kill(pid, signal.SIGKILL)

        blip = await streams_under_blip(client, kill, 0.0)
        print(f"\nnode nats-{victim} SIGKILLed (clients on it: {on_it}; placement {where}), "
              + blip.figures(baseline))
        assert [s.text for s in blip.streams] == [TOY_REPLY] * STREAMS
        assert blip.resumes and max(blip.resumes) < BOUND_S and blip.late(baseline) < BOUND_S
        moved = await placement(stack)
        assert set(moved) == set(stack.procs) and victim not in moved.values()  # they moved to the others
        await asyncio.to_thread(stack.respawn, f"nats-{victim}")  # the supervisor's restart: same port and routes
    balancer = f"http://127.0.0.1:{stack.metrics_ports['balancer-0'][1]}"
    lost = await metric(balancer, "moebus_balancer_workers_lost_total")
    migrations = await metric(stack.url, "moebus_frontend_migrations_total")
    print(f"workers declared lost: {lost:g}, migrations: {migrations:g}, replays: "
          f"{await metric(stack.url, 'moebus_frontend_replays_total'):g}")
    assert lost == 0 and migrations == 0
