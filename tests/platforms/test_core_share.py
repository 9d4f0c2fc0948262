"""Co-located workers sharing the host's cores by who has work (platforms/cpu/core_share.py): each step a
worker takes cores // (workers with work); a dead worker's claim lapses (the worker's engine loop
asking before every step: tests/services/test_engine_loop_pacing.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from moebus.platforms.cpu.core_share import CoreShare, torch_pacer


def test_the_cores_go_to_the_workers_with_work(tmp_path) -> None:
    a, b, c = (CoreShare(tmp_path, name, cores=4, lease_s=10.0, rescan_s=0.0) for name in "abc")
    try:
        assert a.threads(True, now=1.0) == 4  # alone with work: every core
        assert b.threads(True, now=1.0) == 0  # a's step holds them all: b waits for a's next step
        assert a.threads(True, now=1.1) == 2  # a takes its half
        assert b.threads(True, now=1.1) == 2
        assert c.threads(True, now=1.2) == 0
        assert a.threads(True, now=1.3) == 1 and b.threads(True, now=1.3) == 1  # 4 // 3
        assert c.threads(True, now=1.3) == 1
        c.threads(False, now=1.4)  # c's work is done
        assert a.threads(True, now=1.5) == 2 and b.threads(True, now=1.5) == 2
        b.threads(False, now=1.6)
        assert a.threads(True, now=1.7) == 4
        # b dies holding work: its claim lapses after lease_s
        assert b.threads(True, now=2.0) == 0 and a.threads(True, now=2.0) == 2
        assert a.threads(True, now=11.9) == 2 and a.threads(True, now=12.1) == 4
        c.close()  # leaving removes its file: the others forget it at their next rescan
        assert sorted(os.listdir(tmp_path)) == ["a.busy", "b.busy"]
    finally:
        a.close()
        b.close()


def test_a_killed_workers_cores_are_free_at_once(tmp_path) -> None:
    """A worker SIGKILLed in a step that held every core: its file still says busy for lease_s,
    but its process is gone, so the survivor takes the cores at its next step."""
    code = ("import sys, time; from moebus.platforms.cpu.core_share import CoreShare; "
            "s = CoreShare(sys.argv[1], 'dead', cores=2, lease_s=3600.0); print(s.threads(True), flush=True); "
            "time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    a = CoreShare(tmp_path, "a", cores=2, rescan_s=0.0)
    try:
        assert proc.stdout.readline().strip() == "2"  # it holds both cores
        assert a.threads(True) == 0  # alive: a waits for its next step
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert (tmp_path / "dead.busy").exists()  # no close(): the file stays
        assert a.threads(True) == 2
    finally:
        proc.kill()
        proc.wait(10)
        a.close()


def test_more_busy_workers_than_cores_run_a_thread_each(tmp_path) -> None:
    shares = [CoreShare(tmp_path, f"w{i}", cores=2, rescan_s=0.0) for i in range(3)]
    try:
        for s in shares:
            s.threads(True, now=1.0)
        assert [s.threads(True, now=1.1) for s in shares] == [1, 1, 1]  # nobody waits forever
    finally:
        for s in shares:
            s.close()


def test_a_late_scan_finds_a_new_worker(tmp_path) -> None:
    a = CoreShare(tmp_path, "a", cores=2, rescan_s=1.0)
    try:
        assert a.threads(True, now=0.0) == 2
        b = CoreShare(tmp_path, "b", cores=2, rescan_s=1.0)
        assert b.threads(True, now=0.1) == 0
        assert a.threads(True, now=0.5) == 2  # not rescanned yet
        assert a.threads(True, now=1.0) == 1
        assert b.threads(True, now=1.0) == 1
        b.close()
        assert a.threads(True, now=2.0) == 2
    finally:
        a.close()


def test_the_pacer_waits_for_the_cores_then_sets_the_threads(tmp_path) -> None:
    """On an engine thread: b gets work while a holds both cores; b's pacer waits until a's next
    step gives one back, then runs with one thread; alone again, a goes back to two."""
    before = torch.get_num_threads()
    a, b = CoreShare(tmp_path, "a", cores=2, rescan_s=0.0), CoreShare(tmp_path, "b", cores=2, rescan_s=0.0)
    seen: list[tuple[str, int]] = []
    try:
        assert a.threads(True) == 2

        def engine_thread() -> None:
            pace = torch_pacer(b, wait_s=10.0)
            pace(True)
            seen.append(("b", torch.get_num_threads()))
            pace(False)  # idle: nothing set, its claim dropped

        t = threading.Thread(target=engine_thread)
        t.start()
        time.sleep(0.2)  # b's chance to take the cores, were it not to wait
        assert t.is_alive() and not seen  # b waits while a's step holds both cores
        assert a.threads(True) == 1  # a's next step
        t.join(10)
        assert seen == [("b", 1)]
        assert a.threads(True) == 2
    finally:
        a.close()
        b.close()
        torch.set_num_threads(before)


def test_workers_of_one_directory_name_one_group(tmp_path) -> None:
    """The balancer packs requests onto workers of one group (balancer/packing.py): the same host and
    directory is one group, another directory another."""
    a, b = CoreShare(tmp_path / "x", "a", 2), CoreShare(tmp_path / "x", "b", 2)
    c = CoreShare(tmp_path / "y", "c", 2)
    try:
        assert a.group == b.group != c.group
    finally:
        for s in (a, b, c):
            s.close()
