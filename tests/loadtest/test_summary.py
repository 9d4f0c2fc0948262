"""Summary: percentiles, throughput, goodput under the SLO, error and rejection counts; the table."""
from __future__ import annotations

import pytest

from moebus.loadtest.client import RequestRecord
from moebus.loadtest.summary import SLO, percentile, summarize, table


def ok(i: int, sent: float, ttft: float, itl: list[float], out: int = 4) -> RequestRecord:
    e2e = ttft + sum(itl)
    return RequestRecord(i, sent, sent, ttft, itl, e2e, sent + e2e, 10, out, 10, out, 2, 200)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)


def test_summary_counts_goodput_and_errors() -> None:
    recs = [ok(0, 0.0, 0.5, [0.1, 0.1, 0.1]),
            ok(1, 1.0, 3.0, [0.1, 0.1, 0.1]),  # TTFT over the SLO
            ok(2, 2.0, 0.5, [0.1, 0.5, 0.2]),  # mean ITL 267 ms: over
            RequestRecord(3, 3.0, 3.0, done_s=3.1, status=429, error="RateLimitError"),
            RequestRecord(4, 3.0, 3.0, done_s=3.1, status=503, error="InternalServerError"),
            RequestRecord(5, 3.0, 3.0, done_s=3.2, status=None, error="APIConnectionError")]
    s = summarize(recs, SLO(ttft_s=2.0, itl_s=0.2))
    assert (s["requests"], s["ok"], s["errors"], s["rejected"]) == (6, 3, 3, 2)
    assert s["duration_s"] == pytest.approx(4.3)  # first send 0.0, last finish 1.0 + 3.3
    assert s["req_per_s"] == pytest.approx(3 / 4.3)
    assert s["output_tok_per_s"] == pytest.approx(12 / 4.3)
    assert s["goodput_fraction"] == pytest.approx(1 / 6) and s["goodput_req_per_s"] == pytest.approx(1 / 4.3)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["cached_tokens"] == 6
    assert s["itl_s"]["p99"] == pytest.approx(0.2 + 0.92 * 0.3)  # 9 gaps: between the 8th and 9th
    text = table({"a": s, "b": s})
    assert "TTFT p99 ms" in text and "6 (3/3/2)" in text and "SLO (goodput): TTFT <= 2000 ms" in text


def test_itl_both_definitions_and_the_one_the_slo_uses() -> None:
    """Pooled gaps and per-request means differ: one long steady request outweighs a stalled short one."""
    recs = [ok(0, 0.0, 0.5, [0.05] * 19), ok(1, 0.0, 0.5, [0.5])]
    s = summarize(recs, SLO(ttft_s=2.0, itl_s=0.2))
    assert s["itl_s"]["p50"] == pytest.approx(0.05) and s["itl_s"]["mean"] == pytest.approx(1.45 / 20)
    assert s["itl_request_mean_s"]["p50"] == pytest.approx(0.275) and s["itl_request_mean_s"]["p99"] > 0.49
    assert s["goodput_fraction"] == 0.5, "the SLO judges each request's mean gap"
    lines = table({"a": s}).splitlines()
    row = {line.split("  ")[0].strip(): line.split()[-1] for line in lines[1:-1]}
    assert row["ITL (all gaps) p50 ms"] == "50.0" and row["ITL (per-request mean) p50 ms"] == "275.0"
    assert lines[-1] == "SLO (goodput): TTFT <= 2000 ms and ITL (per-request mean) <= 200 ms"
    old = {k: v for k, v in s.items() if k != "itl_request_mean_s"}  # a run summarised before it existed
    assert "ITL (per-request mean) p90 ms" in table({"old": old})
