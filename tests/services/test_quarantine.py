"""Worker quarantine: a suspect enters the engine only when it is empty, and alone."""
from __future__ import annotations

from types import SimpleNamespace

from moebus.services.worker.quarantine import Quarantine


def _active(rid: str, suspect: bool = False) -> SimpleNamespace:
    return SimpleNamespace(req=SimpleNamespace(request_id=rid, suspect=suspect))


def test_suspects_run_alone_and_the_rest_keep_their_order() -> None:
    added: list[str] = []
    q = Quarantine(lambda a: added.append(a.req.request_id))
    q.submit(_active("a"))
    q.submit(_active("b"))
    assert added == ["a", "b"]  # no suspects: straight through
    q.submit(_active("s", suspect=True))
    q.submit(_active("c"))
    assert added == ["a", "b"] and q.held == 2 and q.holds("s") and q.holds("c")
    q.done("a")
    assert added == ["a", "b"]  # b is still in the engine
    q.done("b")
    assert added == ["a", "b", "s"]  # alone
    q.done("s")
    assert added == ["a", "b", "s", "c"] and q.held == 0


def test_a_held_request_that_leaves_is_forgotten() -> None:
    added: list[str] = []
    q = Quarantine(lambda a: added.append(a.req.request_id))
    q.submit(_active("a"))
    q.submit(_active("s", suspect=True))
    q.submit(_active("t", suspect=True))
    q.done("s")  # aborted while held
    assert not q.holds("s") and added == ["a"]
    q.done("a")
    assert added == ["a", "t"]
