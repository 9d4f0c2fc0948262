"""Workers that share one host's cores are one machine's compute, not several: fill one before
waking another.

`moebus up` on a small host starts workers that split the cores by who has work
(platforms/cpu/core_share.py). Spreading a light load over them makes each step of each worker read
all the weights for a share of the rows, on a share of the cores: while a step is memory-bound that
is the weights read twice for the same tokens (bf16 SmolLM2 on 2 cores at c=16: 504 tok/s over two
workers, 627 on one). Once a worker's steps are compute-bound the second worker pays for itself
(its Python part and prefills overlap the first's compute: 945 against 882 tok/s at c=64). So while
a worker of a group holds fewer than its `pack_rows` requests (Load.pack_rows, running + queued,
the worker's config), a request the ranking would give an idle worker of the same group goes to it
instead; past that the ranking's order stands. A cached prefix decides first: the packed worker
must not have more of the prompt to compute than the idle one.
"""
from __future__ import annotations

from .table import WorkerEntry


def held(e: WorkerEntry) -> int:
    """Requests running or queued there, with those sent since its last heartbeat."""
    return (e.beat.load.num_running if e.beat.load else 0) + e.queued


def pack_colocated(order: list[WorkerEntry], prefill_tokens: dict[str, float] | None = None) -> list[WorkerEntry]:
    """`order` (best first) with the fullest packable peer moved ahead of an idle first choice.
    prefill_tokens: worker id -> prompt tokens it would compute (kv_rank.Ranking's); {} or None
    when the order was not ranked by cache."""
    if len(order) < 2:
        return order
    prefill_tokens = prefill_tokens or {}
    first = order[0]
    group = first.beat.load.core_group if first.beat.load else ""
    if not group or held(first) > 0:
        return order
    tokens = prefill_tokens.get(first.worker_id)
    best: WorkerEntry | None = None
    for e in order[1:]:
        load = e.beat.load
        if load is None or load.core_group != group or e.full or not 0 < held(e) < load.pack_rows:
            continue
        if tokens is not None and prefill_tokens.get(e.worker_id, tokens) > tokens:
            continue
        if best is None or held(e) > held(best):
            best = e
    if best is None:
        return order
    return [best, *(e for e in order if e is not best)]
