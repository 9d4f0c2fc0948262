"""Fixtures for test directories that are not packages (tests/engine): a plain helper
module there could not be imported from the other directory, a fixture can."""
from __future__ import annotations

from collections.abc import Callable

import pytest


def _run_counting_preemptions(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], int]:
    """Run `prompts` on an LLMEngine to the end: each prompt's tokens, and how many preemptions
    happened (a preempted request goes back to waiting, so each step's live requests show them all)."""
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    preemptions: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        for r in (*engine.scheduler.running, *engine.scheduler.waiting):
            preemptions[r.request_id] = r.num_preemptions
    return [out[rid] for rid in ids], sum(preemptions.values())


@pytest.fixture
def run_counting_preemptions() -> Callable[..., tuple[list[list[int]], int]]:
    return _run_counting_preemptions
