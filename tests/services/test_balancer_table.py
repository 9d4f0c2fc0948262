"""WorkerTable: least-loaded order with tiebreaks, pending load between heartbeats, expiry."""
from __future__ import annotations

import pytest

from moebus.services.balancer.stalls import LoopStalls
from moebus.services.balancer.table import WorkerTable
from moebus.shared.messages import Heartbeat, Load


def beat(wid: str, waiting: int = 0, running: int = 0, free: int = 100, *, model: str = "m", ready: bool = True,
         draining: bool = False, max_waiting: int = 8) -> Heartbeat:
    return Heartbeat(service="worker", instance_id=wid, ts=0, interval_s=1.0, ready=ready, draining=draining,
                     model=model, load=Load(num_running=running, num_waiting=waiting, max_waiting=max_waiting,
                                            kv_blocks_free=free, kv_blocks_total=100))


def order(t: WorkerTable, now: float = 0.0, **kw) -> list[str]:
    return [e.worker_id for e in t.candidates("m", now, **kw)]


def test_least_loaded_first_with_tiebreaks() -> None:
    t = WorkerTable()
    t.observe(beat("a", waiting=2), 0)
    t.observe(beat("b", waiting=0, running=5), 0)
    t.observe(beat("c", waiting=0, running=1, free=10), 0)
    t.observe(beat("d", waiting=0, running=1, free=50), 0)
    assert order(t) == ["d", "c", "b", "a"]  # queue, then running, then free KV


def test_assignments_count_until_the_next_heartbeat() -> None:
    t = WorkerTable()
    t.observe(beat("a"), 0)
    t.observe(beat("b"), 0)
    picks = []
    for _ in range(4):
        first = order(t)[0]
        picks.append(first)
        t.assigned(first)
    assert sorted(picks) == ["a", "a", "b", "b"], "a burst is spread, not piled on one worker"
    t.observe(beat("a"), 0.5)  # the heartbeat now includes what we sent: pending resets
    assert t.get("a").pending == 0


def test_filters_and_full_workers_last() -> None:
    t = WorkerTable()
    t.observe(beat("full", waiting=8), 0)
    t.observe(beat("busy", waiting=3), 0)
    t.observe(beat("other-model", model="x"), 0)
    t.observe(beat("loading", ready=False), 0)
    t.observe(beat("leaving", draining=True), 0)
    assert order(t) == ["busy", "full"]
    assert order(t, exclude={"busy"}) == ["full"]
    t.skip("busy", now=0)
    assert order(t, now=1.0) == ["full"]
    assert order(t, now=2.0) == ["busy", "full"]


def test_expiry_after_missed_heartbeats() -> None:
    t = WorkerTable(missed_heartbeats=3)
    t.observe(beat("a"), 0)
    t.observe(beat("b"), 0)
    t.observe(beat("b"), 2.5)
    assert t.expire(2.9) == []
    assert t.expire(3.1) == ["a"]
    assert "a" not in t and "b" in t


def test_a_new_process_under_a_known_id_is_a_restart() -> None:
    t = WorkerTable()
    first = beat("a")
    assert not t.observe(first, 0) and not t.observe(first, 1)
    again = first.model_copy(update={"incarnation": "new-process"})
    assert t.observe(again, 2)  # the old process's requests are lost
    assert not t.observe(again, 3) and len(t) == 1


def test_our_own_stalls_do_not_count_as_silence() -> None:
    """Beats every 1 s, 3 missed = dead. The balancer's loop stalled 2.5 s after a's last beat at
    t=10: at t=14 a has been silent 4 s on the clock but only 1.5 s while we could listen."""
    t = WorkerTable()
    t.observe(beat("a"), 10.0)
    t.observe(beat("b"), 0.0)  # silent since before the stall: the stall excuses it too, not enough
    stalls = LoopStalls(horizon_s=100.0, min_lag_s=0.05)
    stalls.record(due=11.0, woke=13.5)  # 2.5 s late
    stalls.record(due=13.5, woke=13.52)  # jitter below min_lag_s: no stall
    assert stalls.since(10.0) == 2.5 and stalls.since(12.0) == 1.5 and stalls.since(13.5) == 0.0
    assert t.silent(14.0) == ["a", "b"]  # without the excuse both look dead
    assert t.silent(14.0, deaf=stalls.since) == ["b"]
    assert t.silent(15.6, deaf=stalls.since) == ["a", "b"]  # 3.1 s heard: a is dead after all


def test_a_loop_late_on_every_round_still_reaps() -> None:
    """Every reaper round fires 0.4 s late (0.5 s sleeps): the lateness is excused, the sleeps are
    not, so a silent worker goes after about 3 s of sleeps, not never."""
    t = WorkerTable()
    t.observe(beat("a"), 0.0)
    stalls = LoopStalls(horizon_s=100.0)
    now, rounds = 0.0, 0
    while not t.silent(now, deaf=stalls.since):
        due, now = now + 0.5, now + 0.9
        stalls.record(due, now)
        rounds += 1
        assert rounds < 20, "never reaped"
    assert rounds == 7  # 7 x 0.5 s heard > 3 s
    stalls.record(now + 0.5, now + 1000.0)  # older stalls are forgotten after the horizon
    assert stalls.since(0.0) == pytest.approx(999.5)
