"""Lost hand-offs are found in seconds (issue #23 item 2): SplitStages against a recording host.
The decode half waits while its prefill half is named by beats, gives up (retryable, blaming the
prefill worker) once the beats stop, never while this worker is itself cut off from the bus; the
prefill side names every split request it holds to its decode worker."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from moebus.services.worker.active import Active
from moebus.services.worker.split import SplitStages
from moebus.shared.errors import ErrorCode
from moebus.shared.messages import GenerateRequest, Handoff, HandoffBeat, KVTransferSpec
from moebus.shared.subjects import Subjects

LOST = 0.4


@dataclass
class FakeBus:
    evidence_since: float = -math.inf
    connected: bool = True


@dataclass
class FakeLink:
    beats: list[tuple[str, list[str]]] = field(default_factory=list)
    receiver: object = True

    async def beat(self, decode_worker: str, transfer_ids: list[str]) -> None:
        self.beats.append((decode_worker, sorted(transfer_ids)))

    async def receive(self, transfer_id: str, timeout: float) -> None:
        return None


class Host:
    """SplitHost, recording what the split asks of the worker."""

    def __init__(self) -> None:
        self.instance_id, self.subjects, self.link, self.bus = "decode-0", Subjects(), FakeLink(), FakeBus()
        self.actives: dict[str, Active] = {}
        self.failed: list[tuple[str, ErrorCode, str, str | None, float]] = []
        self.injected: list[tuple[str, int]] = []

    def spawn(self, coro: Any) -> asyncio.Task:
        return asyncio.ensure_future(coro)

    def active(self, rid: str) -> Active | None:
        return self.actives.get(rid)

    def active_requests(self) -> list[Active]:
        return list(self.actives.values())

    def release(self, rid: str, outcome: str) -> Active | None:
        return self.actives.pop(rid, None)

    def fail(self, rid: str, code: ErrorCode, message: str, *, retryable: bool, counter: str,
             blame: str | None = None) -> None:
        assert retryable
        self.actives.pop(rid, None)
        self.failed.append((rid, code, message, blame, time.monotonic()))

    def send(self, subject: str, message: Any, headers: dict[str, str]) -> None:
        pass

    def inject(self, a: Active, first_token: int, payload: Any) -> None:
        self.injected.append((a.req.request_id, first_token))


def half(host: Host, rid: str, stage: str = "decode", decode: str = "decode-0") -> Active:
    spec = KVTransferSpec(transfer_id=f"{rid}#0", prefill_worker="prefill-0", decode_worker=decode,
                          address="moebus.v1.kvtransfer.push.decode-0", timeout_s=300)
    req = GenerateRequest(request_id=rid, model="m", prompt_token_ids=[1, 2, 3], reply_to="r", stage=stage,
                          kv_transfer=spec)
    a = Active(req=req, trace_headers={}, accepted_at=time.monotonic(), params=None)
    host.actives[rid] = a
    return a


async def beat_for(split: SplitStages, tids: list[str], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await split.on_beat(HandoffBeat(worker_id="prefill-0", transfer_ids=tids), None)
        await asyncio.sleep(0.05)


async def test_a_silent_prefill_half_is_given_up_in_seconds_a_beating_one_is_waited_for() -> None:
    host = Host()
    split = SplitStages(host, beat_s=0.05, lost_s=LOST)
    never, beating, stops = half(host, "never"), half(host, "beating"), half(host, "stops")
    t0 = time.monotonic()
    waits = [asyncio.ensure_future(split.start_decode(a)) for a in (never, beating, stops)]
    await beat_for(split, ["beating#0", "stops#0"], 0.5)  # past LOST: the first beat came in time
    stopped = time.monotonic()
    await beat_for(split, ["beating#0"], 5 * LOST)  # well past 3 x LOST: only a beat keeps one waiting
    await split.on_handoff(Handoff(request_id="beating", first_token=7, kv_sent=False), None)
    await asyncio.wait_for(asyncio.gather(*waits), 10)
    failed = {rid: (code, msg, blame, at) for rid, code, msg, blame, at in host.failed}
    assert set(failed) == {"never", "stops"} and host.injected == [("beating", 7)]
    assert all(code == ErrorCode.WORKER_LOST and blame == "prefill-0" for code, _, blame, _ in failed.values())
    assert "no hand-off beat" in failed["stops"][1]
    # Never named: 3 x LOST from the start (the balancer may still be placing the prefill half).
    assert 3 * LOST <= failed["never"][3] - t0 < 3 * LOST + 2.0
    # Named, then silent: LOST after the last beat (a step before `stopped`), not the spec's 300 s.
    assert LOST - 0.1 <= failed["stops"][3] - stopped < LOST + 2.0
    assert split.lost == 2


async def test_silence_while_this_worker_is_cut_off_is_no_evidence() -> None:
    host = Host()
    host.bus.evidence_since = math.inf  # disconnected
    split = SplitStages(host, beat_s=0.05, lost_s=LOST)
    wait = asyncio.ensure_future(split.start_decode(half(host, "r")))
    await asyncio.sleep(4 * LOST)  # silence well past lost_s: still no verdict
    assert not host.failed and not wait.done()
    host.bus.evidence_since = time.monotonic()  # back: silence counts from now on
    await asyncio.wait_for(wait, 10)
    assert [f[0] for f in host.failed] == ["r"]


async def test_the_prefill_side_names_what_it_holds_to_each_decode_worker() -> None:
    host = Host()
    split = SplitStages(host, beat_s=0.05, lost_s=LOST)
    half(host, "a", stage="prefill", decode="decode-0")
    half(host, "b", stage="prefill", decode="decode-1")
    half(host, "c", stage="prefill", decode="decode-0")
    half(host, "d", stage="decode")  # a decode half is not this worker's to name
    task = asyncio.ensure_future(split.run_beats())
    async with asyncio.timeout(5):
        while not (("decode-0", ["a#0", "c#0"]) in host.link.beats and ("decode-1", ["b#0"]) in host.link.beats):
            await asyncio.sleep(0.01)
    host.actives.clear()
    await asyncio.sleep(0.2)  # a beat already under way may still go out
    n = len(host.link.beats)
    await asyncio.sleep(0.3)  # six beat intervals: none may name anything now
    task.cancel()
    assert len(host.link.beats) == n  # nothing held: no beats
