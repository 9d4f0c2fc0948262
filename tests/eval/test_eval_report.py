"""The report's tables and JSON on a hand-made reference and result."""
from __future__ import annotations

import json
import math

import pytest
import torch

from moebus.eval.metrics import Divergence, GreedyStats, PerplexityStats
from moebus.eval.reference import Reference
from moebus.eval.report import config_table, summary_table, to_json
from moebus.eval.run import Result, Settings
from moebus.eval.text import Chunk


def _stats(nll_sum: float, tokens: int) -> PerplexityStats:
    return PerplexityStats(tokens=tokens, nll_sum=nll_sum, kl_sum=0.002 * tokens, same_top=tokens - 1)


@pytest.fixture
def run() -> tuple[Reference, Result]:
    ref = Reference([Chunk([1, 2, 3, 4])], [torch.zeros(1, 5)], [[7], [8]], 3, [[1, 2, 3], [1, 2, 3]],
                    [torch.zeros(3, 5)] * 2, _stats(2 * math.log(10.0), 2))
    greedy = GreedyStats(2, 0.01, [Divergence(1, 2, 0.004)])
    return ref, Result("bf16", "dense weights, bfloat16", "alone", "decode steps", _stats(2 * math.log(10.5), 2),
                       greedy, 1.0)


def test_tables_are_aligned_and_name_the_tie(run: tuple[Reference, Result]) -> None:
    ref, r = run
    text = config_table(r, ref, Settings(ctx=4))
    assert "matched 1 / ties 1 / divergences 0" in text and "< 0.01" in text
    assert "+5.000%" in text  # PPL 10.5 against 10
    rows = summary_table([r], ref).splitlines()[1:]
    assert len(rows) == 3 and len({len(line) for line in rows}) == 1  # right-aligned to one width
    assert rows[2].split() == ["bf16", "alone", "10.5000", "+5.000%", "2.00e-03", "50.00%", "1/2", "1", "0"]


def test_json_holds_every_number(run: tuple[Reference, Result]) -> None:
    ref, r = run
    d = json.loads(json.dumps(to_json([r], ref, Settings())))
    c = d["configs"][0]
    assert d["reference"]["ppl"] == pytest.approx(10.0)
    assert c["ppl_diff_pct"] == pytest.approx(5.0) and c["kl"] == pytest.approx(0.002)
    assert c["greedy"]["divergences"] == [{"prompt": 1, "position": 2, "margin": 0.004, "tie": True}]


def test_counters_and_tokens_are_reported(run: tuple[Reference, Result]) -> None:
    ref, r = run
    r.counters, r.tokens = {"drafted": 6, "accepted": 2}, [[1, 2, 3], [1, 2, 4]]
    assert config_table(r, ref, Settings(ctx=4)).splitlines()[-1] == "  drafted 6, accepted 2"
    assert "synthetic token ids" in config_table(r, ref, Settings(ctx=4, synthetic=True))
    c = to_json([r], ref, Settings())["configs"][0]
    assert c["counters"] == {"drafted": 6, "accepted": 2} and c["tokens"] == [[1, 2, 3], [1, 2, 4]]
