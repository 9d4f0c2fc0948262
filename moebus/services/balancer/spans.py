"""What the route span says about a routing decision: mode, policy, the candidates and their load.

The decision's reason (`moebus.route.reason`) is set where it is made: kv_rank.py for the KV-aware
policy (prefix_hit, no_prefix, index_unavailable, load_only), here for the static policies."""
from __future__ import annotations

from moebus.shared.messages import GenerateRequest
from moebus.shared.tracing import Attr, annotate

from .config import BalancerConfig
from .table import WorkerEntry


def route_attributes(cfg: BalancerConfig, req: GenerateRequest, cands: list[WorkerEntry],
                     roles: tuple[str, ...] | None) -> None:
    pool = "any" if roles is None else roles[0]
    attrs = {Attr.MODEL: req.model, Attr.GENERATION_ID: req.request_id, "moebus.route.mode": cfg.mode,
             "moebus.route.policy": cfg.policy, "moebus.attempt": req.attempt,
             f"moebus.route.candidates.{pool}": [f"{e.worker_id} queued={e.queued} running="
                                                 f"{e.beat.load.num_running if e.beat.load else 0}" for e in cands]}
    if cfg.policy != "kv" or not cfg.kv_aware:
        attrs["moebus.route.reason"] = cfg.policy if cfg.policy != "kv" else "load_only"
    annotate(attrs)
