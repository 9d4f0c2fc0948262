"""Run summary: throughput, TTFT / ITL / E2E percentiles, goodput under an SLO, errors.

ITL has two definitions, both reported: every gap between chunks of every request pooled
("all gaps", itl_s: long requests weigh more, stalls show in the tail), and each request's mean gap
("per-request mean", itl_request_mean_s: vLLM's TPOT, aiperf's ITL). They differ a lot on real
traces. Goodput counts the requests that succeeded with TTFT <= slo.ttft_s and a per-request mean
gap <= slo.itl_s, per second of the run (vLLM's and DistServe's definition)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .client import REJECTED, RequestRecord

PCTS = (50, 90, 99)


@dataclass(slots=True)
class SLO:
    ttft_s: float = 2.0
    itl_s: float = 0.2

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return not r.itl_s or mean_gap(r) <= self.itl_s


def mean_gap(r: RequestRecord) -> float:
    """The request's mean inter-token gap (per-request mean ITL, TPOT); only for itl_s non-empty."""
    return sum(r.itl_s) / len(r.itl_s)


def percentile(xs: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{p}": percentile(xs, p) for p in PCTS}
    out["mean"] = sum(xs) / len(xs) if xs else None
    return out


def summarize(records: list[RequestRecord], slo: SLO, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    starts = [r.sent_s for r in records if r.status is not None or r.error]
    ends = [r.done_s for r in records if r.done_s is not None]
    duration = max(ends) - min(starts) if starts and ends else 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    good = sum(slo.met(r) for r in records)
    lag = [r.sent_s - r.scheduled_s for r in records if r.status is not None or r.error]
    return {
        "meta": meta or {},
        "slo": asdict(slo),
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "rejected": sum(r.status in REJECTED for r in records),
        "cancelled": sum(r.error == "cancelled" for r in records),
        "duration_s": duration,
        "req_per_s": per_s(len(ok)),
        "output_tok_per_s": per_s(out_tokens),
        "input_tok_per_s": per_s(prompt_tokens),
        "goodput_req_per_s": per_s(good),
        "goodput_fraction": good / len(records) if records else 0.0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": _dist([g for r in ok for g in r.itl_s]),  # all gaps pooled
        "itl_request_mean_s": _dist([mean_gap(r) for r in ok if r.itl_s]),  # what the SLO judges
        "e2e_s": _dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "send_lag_s": _dist(lag),
    }


ROWS = [("requests (ok/err/429+503)", lambda s: f"{s['requests']} ({s['ok']}/{s['errors']}/{s['rejected']})"),
        ("duration s", lambda s: f"{s['duration_s']:.1f}"),
        ("req/s", lambda s: f"{s['req_per_s']:.2f}"),
        ("output tok/s", lambda s: f"{s['output_tok_per_s']:.1f}"),
        ("goodput req/s (share)", lambda s: f"{s['goodput_req_per_s']:.2f} ({100 * s['goodput_fraction']:.0f}%)"),
        ("cached / prompt tokens", lambda s: f"{s['cached_tokens'] or 0}/{s['prompt_tokens']}")]
ITL_ALL, ITL_MEAN = "ITL (all gaps)", "ITL (per-request mean)"
for _k, _label in (("ttft_s", "TTFT"), ("itl_s", ITL_ALL), ("itl_request_mean_s", ITL_MEAN), ("e2e_s", "E2E")):
    for _p in PCTS:  # (a run summarised before itl_request_mean_s existed shows "-")
        ROWS.append((f"{_label} p{_p} ms", lambda s, k=_k, p=_p: _ms(s.get(k, {}).get(f"p{p}"))))
ROWS.append(("send lag p99 ms", lambda s: _ms(s["send_lag_s"]["p99"])))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """One column per run, one row per metric."""
    names = list(summaries)
    cells = [[label, *(fmt(summaries[n]) for n in names)] for label, fmt in ROWS]
    header = ["", *names]
    widths = [max(len(str(r[i])) for r in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                 strict=True)))
             for r in [header, *cells]]
    slo = summaries[names[0]]["slo"]
    lines.append(f"SLO (goodput): TTFT <= {slo['ttft_s'] * 1000:.0f} ms and {ITL_MEAN} <= "
                 f"{slo['itl_s'] * 1000:.0f} ms")
    return "\n".join(lines)
