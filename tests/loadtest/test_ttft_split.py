"""The c=1 TTFT cut into the stack's hops from trace spans (moebus/loadtest/ttft_split.py): the legs
follow the critical path, so they add up to the client's TTFT, and the engine step is set apart."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from moebus.loadtest.ttft_split import LEGS, OVERHEAD, STEP_PARTS, TTFT_ATTR, medians, quantile, split_all

MS = 1_000_000  # ns


@dataclass
class Rec:
    sent_unix: float
    ttft_s: float | None
    ok: bool = True


def trace(tid: str, t0_ns: int) -> list[dict]:
    """One request's spans: HTTP at +1 ms, render 2-3, route 4-9 (its reply ends after the worker's
    admission), worker generate 5-6, queue 6-7, prefill 7-107, decode from 107."""
    def span(name: str, a: float, b: float) -> dict:
        return {"trace_id": tid, "name": name, "start_ns": t0_ns + int(a * MS), "end_ns": t0_ns + int(b * MS)}
    return [span("POST /v1/chat/completions", 1, 120), span("render", 2, 3), span("generate toy", 3.5, 119),
            span("route", 4, 9), span("generate", 5, 6), span("queue", 6, 7), span("prefill", 7, 107),
            span("decode", 107, 118)]


def test_legs_add_up_to_the_ttft_and_overhead_leaves_the_engine_step_out() -> None:
    t0 = 1_700_000_000 * 10**9
    rec = Rec(sent_unix=t0 / 1e9, ttft_s=0.110)  # first token at +110 ms
    (leg,) = split_all(trace("a", t0), [rec])
    assert list(leg) == [*LEGS, OVERHEAD]
    assert leg["client->http"] == pytest.approx(1, abs=1e-3) and leg["render(tokenizer)"] == pytest.approx(1, abs=1e-3)
    assert leg["route->worker(balancer)"] == pytest.approx(1, abs=1e-3) and leg["admit->step(worker queue)"] == pytest.approx(1, abs=1e-3)
    assert leg["engine_step"] == pytest.approx(100, abs=1e-3) and leg["step->client"] == pytest.approx(3, abs=1e-3)
    assert sum(leg[k] for k in LEGS) == pytest.approx(110, abs=1e-3)
    assert leg[OVERHEAD] == pytest.approx(10, abs=1e-3)


def test_step_to_client_is_cut_where_the_frontend_had_the_token() -> None:
    t0 = 1_700_000_000 * 10**9
    spans = trace("a", t0)
    gen = next(s for s in spans if s["name"] == "generate toy")
    gen["attributes"] = {TTFT_ATTR: 0.105}  # the frontend had it at +3.5 + 105 = 108.5 ms, 1.5 after the step
    (leg,) = split_all(spans, [Rec(sent_unix=t0 / 1e9, ttft_s=0.110)])
    assert leg["step->frontend"] == pytest.approx(1.5, abs=1e-3) and leg["frontend->client"] == pytest.approx(1.5, abs=1e-3)
    assert sum(leg[k] for k in STEP_PARTS) == pytest.approx(leg["step->client"], abs=1e-3)
    assert sum(leg[k] for k in LEGS) == pytest.approx(110, abs=1e-3)  # the parts are not in the sum
    assert medians([leg, split_all(trace("b", t0), [Rec(t0 / 1e9, 0.110)])[0]])["step->frontend"] == pytest.approx(1.5, abs=1e-3)


def test_each_request_gets_the_trace_sent_nearest_it() -> None:
    t0 = 1_700_000_000 * 10**9
    spans = trace("a", t0) + trace("b", t0 + 2 * 10**9) + [{"trace_id": "c", "name": "heartbeat", "start_ns": t0,
                                                            "end_ns": t0}]
    recs = [Rec(t0 / 1e9 + 2, 0.112), Rec(t0 / 1e9, 0.110), Rec(t0 / 1e9 + 9, 0.1),  # nothing sent near +9 s
            Rec(t0 / 1e9, None, ok=False)]
    legs = split_all(spans, recs)
    assert [round(x[OVERHEAD]) for x in legs] == [12, 10]
    assert medians(legs)[OVERHEAD] == pytest.approx(11, abs=1e-3)
    assert split_all([s for s in trace("a", t0) if s["name"] != "generate"], recs[1:2]) == []  # a span missing


def test_quantile() -> None:
    assert quantile([4, 1, 3, 2], 0.5) == pytest.approx(2.5)
    assert (quantile([5], 0.9), quantile([1, 2, 3], 0.0), quantile([1, 2, 3], 1.0)) == (5, 1, 3)
