"""The fleet as a frontend hears it on the bus: one `InstanceStatus` per service instance, from its
heartbeats. The frontend exports the rows as gauges on its /metrics (`moebus_frontend_fleet_*`);
`moebus status` scrapes that page and reads them back. Both sides use these names, so they are
kept here, beside the two conversions, and nowhere else.

Label names avoid `instance`, `service` and `instance_id`: a Prometheus scraping the frontend sets
those on every series of the target (file_sd, deploy/prometheus) and would rename ours.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

State = Literal["ready", "starting", "draining", "missing"]
STATES: tuple[State, ...] = ("ready", "starting", "draining", "missing")
PREFIX = "moebus_frontend_fleet_"
MEMBER = ("member", "member_service")  # labels of the per-instance gauges
WORKER = "worker"  # label of the per-worker gauges: the worker's instance id


class InstanceStatus(BaseModel):
    """One process of the stack. Load fields are None where the instance reports no load (every
    service but the workers) or nothing is known (missing)."""

    instance_id: str
    service: str
    state: State
    restarts: int = 0  # restarts by the supervisor (`moebus up`), as its last heartbeat said
    heartbeat_age_s: float | None = None  # since its last heartbeat; None: never heard
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1 of its KV blocks
    prefix_cache_hit_rate: float | None = None  # prompt tokens found cached / looked up, since it started
    output_tokens_per_s: float | None = None  # generated, over the last seconds of heartbeats
    ttft_p50_s: float | None = None  # accept -> first token over the worker's latency window
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None
    itl_p90_s: float | None = None


# Per-worker gauges: metric suffix -> the InstanceStatus field it carries.
WORKER_GAUGES = {
    "requests_running": ("running", "Requests in the worker's running batch (its last heartbeat)"),
    "requests_waiting": ("waiting", "Requests the worker accepted that have no token yet"),
    "kv_cache_usage_perc": ("kv_usage", "The worker's KV cache usage (1 = full)"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prompt tokens found in the worker's prefix cache / "
                              "looked up, since it started"),
    "generation_tokens_per_second": ("output_tokens_per_s", "Tokens the worker generated per second, over "
                                     "its last heartbeats"),
}
QUANTILE_GAUGES = {  # metric suffix -> {quantile label: field}
    "time_to_first_token_seconds": {"0.5": "ttft_p50_s", "0.9": "ttft_p90_s"},
    "inter_token_latency_seconds": {"0.5": "itl_p50_s", "0.9": "itl_p90_s"},
}


def to_families(rows: Iterable[InstanceStatus]) -> list[Metric]:
    """The gauges of these rows (a collector's collect())."""
    rows = list(rows)
    state = GaugeMetricFamily(PREFIX + "state", "1 for the instance's state (ready, starting: not ready yet, "
                              "draining, missing: silent for 3 heartbeats), 0 for the others",
                              labels=[*MEMBER, "state"])
    restarts = GaugeMetricFamily(PREFIX + "restarts", "Times the supervisor restarted the instance",
                                 labels=list(MEMBER))
    age = GaugeMetricFamily(PREFIX + "heartbeat_age_seconds", "Seconds since the instance's last heartbeat",
                            labels=list(MEMBER))
    workers = {suffix: GaugeMetricFamily(PREFIX + suffix, doc, labels=[WORKER])
               for suffix, (_, doc) in WORKER_GAUGES.items()}
    quantiles = {suffix: GaugeMetricFamily(PREFIX + suffix, f"The worker's {suffix.removesuffix('_seconds')} "
                                           "(seconds) over its latency window", labels=[WORKER, "quantile"])
                 for suffix in QUANTILE_GAUGES}
    for r in rows:
        member = [r.instance_id, r.service]
        for s in STATES:
            state.add_metric([*member, s], float(s == r.state))
        restarts.add_metric(member, r.restarts)
        if r.heartbeat_age_s is not None:
            age.add_metric(member, r.heartbeat_age_s)
        for suffix, (name, _) in WORKER_GAUGES.items():
            if (value := getattr(r, name)) is not None:
                workers[suffix].add_metric([r.instance_id], value)
        for suffix, fields in QUANTILE_GAUGES.items():
            for q, name in fields.items():
                if (value := getattr(r, name)) is not None:
                    quantiles[suffix].add_metric([r.instance_id, q], value)
    return [state, restarts, age, *workers.values(), *quantiles.values()]


def from_text(text: str) -> list[InstanceStatus]:
    """The rows in a /metrics page (the frontend's), sorted by service and id; other series are ignored.
    ValueError: not Prometheus text, or no fleet gauges in it (not a moebus frontend)."""
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith(PREFIX)]
    if not any(f.name == PREFIX + "state" for f in families):
        raise ValueError(f"no {PREFIX}state gauge on the page")
    fields: dict[str, dict[str, object]] = {}
    for name, labels, value in ((s.name, s.labels, s.value) for f in families for s in f.samples):
        suffix = name.removeprefix(PREFIX)
        if suffix == "state":
            row = fields.setdefault(labels["member"], {"service": labels["member_service"]})
            if value == 1:
                row["state"] = labels["state"]
        elif suffix in ("restarts", "heartbeat_age_seconds"):
            row = fields.setdefault(labels["member"], {"service": labels["member_service"]})
            row["restarts" if suffix == "restarts" else "heartbeat_age_s"] = value
        elif suffix in WORKER_GAUGES:
            fields.setdefault(labels[WORKER], {})[WORKER_GAUGES[suffix][0]] = value
        elif suffix in QUANTILE_GAUGES and labels.get("quantile") in QUANTILE_GAUGES[suffix]:
            fields.setdefault(labels[WORKER], {})[QUANTILE_GAUGES[suffix][labels["quantile"]]] = value
    rows = [InstanceStatus(instance_id=i, **f) for i, f in fields.items() if "service" in f and "state" in f]
    return sorted(rows, key=lambda r: (r.service, r.instance_id))
