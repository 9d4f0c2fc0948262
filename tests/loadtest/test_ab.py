"""moebus.loadtest.ab: variants alternate A B / B A, warm-up rounds are untimed, medians and spread
come from the timed rounds (a fake clock: each call's cost is what the test says)."""
from __future__ import annotations

import pytest

from moebus.loadtest.ab import Rounds, alternate, wins


class FakeClock:
    """Time advances only when a variant runs: by the cost the test gives it for that call."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_alternates_and_times_each_call() -> None:
    clock, calls = FakeClock(), []
    costs = {"a": iter([9.0, 1.0, 2.0, 3.0, 10.0]), "b": iter([9.0, 5.0, 4.0, 6.0, 0.5])}

    def variant(name: str):
        def run() -> None:
            calls.append(name)
            clock.now += next(costs[name])
        return run

    timed = alternate({"a": variant("a"), "b": variant("b")}, 4, warmup=1, clock=clock)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert timed["a"].samples == (1.0, 2.0, 3.0, 10.0) and timed["b"].samples == (5.0, 4.0, 6.0, 0.5)
    assert timed["a"].median == 2.5 and timed["a"].spread == (1.0, 10.0)
    assert timed["b"].median == 4.5 and timed["b"].spread == (0.5, 6.0)
    assert wins(timed["a"], timed["b"]) == 3 and wins(timed["b"], timed["a"]) == 1


def test_bad_rounds() -> None:
    with pytest.raises(ValueError):
        alternate({"a": lambda: None}, 0)
    with pytest.raises(ValueError):
        Rounds(())
