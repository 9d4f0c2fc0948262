"""Workers sharing a host's cores are filled one at a time up to their pack_rows (balancer/packing.py);
workers of other groups, a cached prefix elsewhere, and a full or past-its-rows worker keep the
ranking's order."""
from __future__ import annotations

from moebus.services.balancer.packing import pack_colocated
from moebus.services.balancer.table import WorkerTable
from moebus.shared.messages import Heartbeat, Load


def beat(wid: str, running: int = 0, waiting: int = 0, group: str = "host:/cores", pack: int = 32,
         max_waiting: int = 64) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=wid, ts=0, interval_s=1.0, model="m",
                     load=Load(num_running=running, num_waiting=waiting, max_waiting=max_waiting,
                               kv_blocks_free=100, kv_blocks_total=100, core_group=group, pack_rows=pack))


def table(*beats: Heartbeat) -> WorkerTable:
    t = WorkerTable()
    for b in beats:
        t.observe(b, 0)
    return t


def ids(order) -> list[str]:
    return [e.worker_id for e in order]


def route_burst(t: WorkerTable, n: int) -> list[str]:
    """n requests routed before any heartbeat: the table's least-loaded order, then packing."""
    picks = []
    for _ in range(n):
        first = pack_colocated(t.candidates("m", 0.0))[0].worker_id
        t.assigned(first)
        picks.append(first)
    return picks


def test_a_burst_fills_one_worker_up_to_its_rows_then_wakes_the_other() -> None:
    t = table(beat("a", pack=4), beat("b", pack=4))
    picks = route_burst(t, 10)
    assert picks[:4] == [picks[0]] * 4, picks  # the first four pile on one worker
    other = "b" if picks[0] == "a" else "a"
    assert picks[4] == other  # the fifth finds the first at its rows: the idle one is woken
    assert picks.count("a") == 5 and picks.count("b") == 5  # then the usual spread


def test_without_a_group_the_burst_is_spread() -> None:
    t = table(beat("a", group=""), beat("b", group=""))
    assert sorted(route_burst(t, 4)) == ["a", "a", "b", "b"]


def test_workers_of_other_hosts_are_not_packed_onto() -> None:
    t = table(beat("a", running=3, group="h1:/c"), beat("b", group="h2:/c"))
    assert ids(pack_colocated(t.candidates("m", 0.0))) == ["b", "a"]


def test_a_busy_first_choice_or_a_full_peer_keeps_the_order() -> None:
    t = table(beat("a", running=2), beat("b", running=5))
    assert ids(pack_colocated(t.candidates("m", 0.0))) == ["a", "b"]  # both busy: the ranking decides
    t = table(beat("a"), beat("b", running=1, waiting=4, max_waiting=4))
    assert ids(pack_colocated(t.candidates("m", 0.0))) == ["a", "b"]  # b's queue is full
    t = table(beat("a"), beat("b", running=32))
    assert ids(pack_colocated(t.candidates("m", 0.0))) == ["a", "b"]  # b is at its rows


def test_the_fullest_packable_peer_is_chosen() -> None:
    t = table(beat("a"), beat("b", running=3), beat("c", running=7))
    assert ids(pack_colocated(t.candidates("m", 0.0)))[0] == "c"


def test_a_cached_prefix_on_the_idle_worker_wins() -> None:
    t = table(beat("a"), beat("b", running=3))
    order = t.candidates("m", 0.0)
    assert ids(pack_colocated(order, {"a": 16.0, "b": 512.0}))[0] == "a"  # a holds most of the prompt
    assert ids(pack_colocated(order, {"a": 512.0, "b": 512.0}))[0] == "b"  # no cache either way: pack
