"""Worker quarantine: suspects run as one batch, with nobody else in the engine; a batch that
breaks the engine is split in halves that run one after the other; isolated suspects run alone."""
from __future__ import annotations

from types import SimpleNamespace

from moebus.services.worker.quarantine import Quarantine


def _active(rid: str, suspect: bool = False, isolate: bool = False) -> SimpleNamespace:
    return SimpleNamespace(req=SimpleNamespace(request_id=rid, suspect=suspect or isolate, isolate=isolate))


def _queue() -> tuple[Quarantine, list[str]]:
    added: list[str] = []
    return Quarantine(lambda a: added.append(a.req.request_id)), added


def test_suspects_run_together_apart_from_the_rest_who_keep_their_order() -> None:
    q, added = _queue()
    q.submit(_active("a"))
    q.submit(_active("b"))
    assert added == ["a", "b"]  # no suspects: straight through
    q.submit(_active("s", suspect=True))
    q.submit(_active("c"))
    q.submit(_active("t", suspect=True))
    assert added == ["a", "b"] and q.held == 3 and q.holds("s") and q.holds("c")
    q.done("a")
    assert added == ["a", "b"]  # b is still in the engine
    q.done("b")
    assert added == ["a", "b", "s", "t"] and q.batch == {"s", "t"}  # together, ahead of c
    q.submit(_active("u", suspect=True))
    assert added[-1] == "u" and q.batch == {"s", "t", "u"}  # a later suspect joins the running batch
    q.done("s")
    q.done("t")
    assert "c" not in added  # nobody else beside the batch
    q.done("u")
    assert added[-1] == "c" and q.held == 0


def test_a_batch_that_breaks_the_engine_runs_again_in_halves_one_after_the_other() -> None:
    q, added = _queue()
    for r in "abcd":
        q.submit(_active(r, suspect=True))
    assert q.batch == set("abcd")
    q.submit(_active("n"))
    q.bisect([_active(r, suspect=True) for r in "abcd"])  # the engine broke with all four
    assert q.batch == {"a", "b"} and added[-2:] == ["a", "b"]
    q.submit(_active("e", suspect=True))
    assert q.batch == {"a", "b"}, "nobody joins a half"
    q.bisect([_active(r, suspect=True) for r in "ab"])  # broke again: split again
    assert q.batch == {"a"}
    q.done("a")  # the worker failed it: it broke the engine alone
    assert q.batch == {"b"}
    q.done("b")
    assert q.batch == {"c", "d"}  # the other half of the first split
    q.done("c")
    q.done("d")
    assert added[-1] == "n" and not q.batch  # then the rest in arrival order: n came before e
    q.done("n")
    assert q.batch == {"e"} and q.held == 0


def test_isolated_suspects_run_alone_and_leaving_while_held_is_forgotten() -> None:
    q, added = _queue()
    q.submit(_active("a"))
    q.submit(_active("i", isolate=True))
    q.submit(_active("s", suspect=True))
    q.done("a")
    assert added == ["a", "i"] and q.batch == {"i"}
    q.submit(_active("t", suspect=True))
    assert q.batch == {"i"}, "nobody joins an isolated suspect"
    q.done("s")  # aborted while held
    assert not q.holds("s")
    q.done("i")
    assert added == ["a", "i", "t"]
