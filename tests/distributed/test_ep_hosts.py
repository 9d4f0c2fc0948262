"""launch_ep_group's `rank_setup`: run in each rank first; with netns.InNamespaces the two ranks live on
two hosts (network namespaces joined by a router) and their collectives cross the veth path."""
from __future__ import annotations

import os

import pytest

from moebus.engine.distributed.dp_engine import DPEngine
from moebus.engine.distributed.launcher import launch_ep_group
from moebus.services.netns import Hosts, InNamespaces, available
from moebus.shared.ports import free_port

from .common import ENGINE_KWARGS, PRELOAD, greedy, prompt

pytestmark = pytest.mark.slow  # group launches: the slow tier (./run test-slow)
SETUP_ENV = "MOEBUS_TEST_RANK_SETUP"


def mark_rank(rank: int) -> None:
    os.environ[SETUP_ENV] = str(rank)


def fail_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("no such host")


def report(engine: DPEngine) -> dict:
    rank = engine.group.rank
    engine.add_request(f"r{rank}", prompt(9, seed=rank), greedy(4))
    tokens = engine.run_to_completion()  # collectives over whatever path the ranks share
    return {"setup": os.environ.get(SETUP_ENV), "net_ns": os.stat("/proc/thread-self/ns/net").st_ino,
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "tokens": tokens[f"r{rank}"]}


def test_rank_setup_runs_in_each_rank(moe_ckpt):
    results = launch_ep_group(str(moe_ckpt), 2, report, engine_kwargs=ENGINE_KWARGS, start_method="forkserver",
                              preload=PRELOAD, timeout_s=120, rank_setup=mark_rank)
    assert [r["setup"] for r in results] == ["0", "1"]
    assert all(len(r["tokens"]) == 4 for r in results)
    assert SETUP_ENV not in os.environ  # the launcher's own process is untouched


def test_a_failing_rank_setup_is_raised(moe_ckpt):
    with pytest.raises(RuntimeError, match="EP rank 1 failed(.|\n)*no such host"):
        launch_ep_group(str(moe_ckpt), 2, report, engine_kwargs=ENGINE_KWARGS, start_method="forkserver",
                        preload=PRELOAD, timeout_s=60, rank_setup=fail_rank_1)


@pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")
def test_ranks_on_two_hosts(moe_ckpt):
    with Hosts(["a", "b"]) as net:
        host = net.address("a")
        port = net.run_in("a", lambda: free_port(host))  # the rendezvous: rank 0's address, in its namespace
        on_hosts = launch_ep_group(str(moe_ckpt), 2, report, engine_kwargs=ENGINE_KWARGS, host=host, port=port,
                                   start_method="forkserver", preload=PRELOAD, timeout_s=120,
                                   rank_setup=InNamespaces((net.ns("a"), net.ns("b"))))
        namespaces = [os.stat(f"/run/netns/{net.ns(h)}").st_ino for h in ("a", "b")]
    assert [r["net_ns"] for r in on_hosts] == namespaces
    assert [r["ifname"] for r in on_hosts] == ["eth0", "eth0"]
    local = launch_ep_group(str(moe_ckpt), 2, report, engine_kwargs=ENGINE_KWARGS, start_method="forkserver",
                            preload=PRELOAD, timeout_s=120)
    assert [r["tokens"] for r in on_hosts] == [r["tokens"] for r in local]  # same model, same tokens
