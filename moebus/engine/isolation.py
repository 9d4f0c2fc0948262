"""Per-request fault isolation: a failure in batched work is blamed on the requests that fail alone.

The engine batches many requests into each step, so one request whose parameters or state make
a batched call raise (an out-of-range value turned into a tensor, a broken grammar) would fail
everybody's step. Batched code wraps such calls in `isolate`: when the batch raises, each item is
tried on its own, and the ones that still raise are named in a `RequestFailed`; the engine fails
those requests alone and recomputes the rest. Nobody failing alone leaves the batch's own error
standing (a fault of the engine, not of one request).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestFailed(Exception):
    """Requests whose own state raised at `stage`: request id -> the error each raised."""

    def __init__(self, stage: str, failures: dict[str, BaseException]) -> None:
        super().__init__(f"{stage}: {len(failures)} request(s) failed: {', '.join(failures)}")
        self.stage = stage
        self.failures = failures

    def message(self, request_id: str) -> str:
        e = self.failures[request_id]
        return f"request failed in the engine ({self.stage}): {type(e).__name__}: {e}"


def isolate(stage: str, keys: Sequence[str], batch: Callable[[], T], alone: Callable[[int], object]) -> T:
    """batch(); if it raises, alone(i) for every i to find the items that raise by themselves.

    Raises RequestFailed naming them (chained to the batch's error), or the batch's error when
    none does. `alone` must leave no state behind that the retried step would see.
    """
    try:
        return batch()
    except Exception as exc:
        failures: dict[str, BaseException] = {}
        for i, key in enumerate(keys):
            try:
                alone(i)
            except Exception as e:  # this item's own fault
                failures[key] = e
        if not failures:
            raise
        log.warning("%s failed for %s: %r", stage, list(failures), exc)
        raise RequestFailed(stage, failures) from exc
