"""A request's time to first token cut into the hops of the stack, from the services' trace spans
(`moebus up --trace-file`, shared/trace_export.py) and the client's own send and first-token times.

The legs follow the critical path to the first token, so they add up to the client's TTFT:
client -> HTTP span -> `render` (in the frontend with `local_render`, which `moebus up` sets; else the
tokenizer service's) -> balancer `route` -> worker `generate` (admission) ->
the engine step that made the first token (`prefill`) -> the client reading it. The route's reply
to the frontend runs beside the worker's queue and step, off that path. `engine_step` is the
engine's own work; every other leg is the stack's overhead (issue 21, target 3).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

# The stack's hops, in order (names of the legs `split_request` returns, engine_step included).
LEGS = ("client->http", "http->render", "render(tokenizer)", "render->route", "route->worker(balancer)",
        "generate(worker admit)", "admit->step(worker queue)", "engine_step", "step->client")
OVERHEAD = "overhead(ttft-engine_step)"
# step->client in two, where the frontend's `generate <model>` span has its own TTFT: the token's way
# to the frontend (worker loop, bus) and on to the client (SSE write, client); not in the sum.
STEP_PARTS = ("step->frontend", "frontend->client")
TTFT_ATTR = "gen_ai.server.time_to_first_token"
_NEED = ("render", "route", "generate", "prefill")  # span names (the worker's consume span is `generate`)
MAX_SKEW_S = 0.5  # a trace whose HTTP span starts further than this from the client's send is not its own


class Sent(Protocol):
    """What the client measured (moebus.loadtest.client.RequestRecord has these)."""

    ok: bool
    sent_unix: float
    ttft_s: float | None


def group_traces(spans: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    traces: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        traces.setdefault(s["trace_id"], []).append(s)
    return traces


def split_request(rec: Sent, spans: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """ms per leg of one request's TTFT from its trace's spans; None when a span is missing."""
    by: dict[str, dict[str, Any]] = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        key = "POST" if s["name"].startswith("POST ") else s["name"]
        by.setdefault(key, s)  # the first attempt's (a migrated request routes again)
    if "POST" not in by or any(k not in by for k in _NEED) or rec.ttft_s is None:
        return None
    sent_ns, first_ns = rec.sent_unix * 1e9, (rec.sent_unix + rec.ttft_s) * 1e9
    marks = [sent_ns, by["POST"]["start_ns"], by["render"]["start_ns"], by["render"]["end_ns"],
             by["route"]["start_ns"], by["generate"]["start_ns"], by["generate"]["end_ns"],
             by["prefill"]["start_ns"], by["prefill"]["end_ns"], first_ns]
    leg = {name: (b - a) / 1e6 for name, a, b in zip(LEGS, marks[:-1], marks[1:], strict=True)}
    leg[OVERHEAD] = 1000 * rec.ttft_s - leg["engine_step"]
    gen = next((s for s in spans if s["name"].startswith("generate ") and TTFT_ATTR in s.get("attributes", {})), None)
    if gen is not None:  # the frontend's clock starts a few us after its span: about right
        at_frontend = gen["start_ns"] + gen["attributes"][TTFT_ATTR] * 1e9
        leg[STEP_PARTS[0]] = (at_frontend - by["prefill"]["end_ns"]) / 1e6
        leg[STEP_PARTS[1]] = (first_ns - at_frontend) / 1e6
    return leg


def split_all(spans: Iterable[dict[str, Any]], recs: Sequence[Sent]) -> list[dict[str, float]]:
    """Per ok request, the legs of the trace whose HTTP span started nearest its send time."""
    traces = group_traces(spans)
    roots = sorted((min(s["start_ns"] for s in ss if s["name"].startswith("POST ")) / 1e9, tid)
                   for tid, ss in traces.items() if any(s["name"].startswith("POST ") for s in ss))
    out = []
    for r in recs:
        if not r.ok or r.ttft_s is None or not roots:
            continue
        start, tid = min(roots, key=lambda x: abs(x[0] - r.sent_unix))
        if abs(start - r.sent_unix) <= MAX_SKEW_S and (leg := split_request(r, traces[tid])) is not None:
            out.append(leg)
    return out


def medians(legs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median ms of each leg over the requests that have it ({} for none)."""
    keys = dict.fromkeys(k for leg in legs for k in leg)
    return {k: statistics.median(leg[k] for leg in legs if k in leg) for k in keys}


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation (xs non-empty)."""
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)
