"""Replays against the toy stack: the trace's clock is kept, lengths are exact end to end, the run
folder gets its JSONL, summary and plots, runs compare, and an interrupt keeps what finished."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from moebus.cli import main
from moebus.loadtest.cli import default_results_dir
from moebus.loadtest.client import make_client
from moebus.loadtest.formats import read_trace
from moebus.loadtest.prompts import PromptSynth, load_tokenizer
from moebus.loadtest.runner import Pacing, Target, replay
from moebus.loadtest.session import LoadTest, run_loadtest
from moebus.loadtest.trace import Shaping, TraceRequest

from .conftest import toy_stack
from .test_formats import AZURE

ARRIVALS = [0.0, 0.05, 0.1, 0.4, 0.45, 0.8, 1.2, 1.25, 1.3, 1.6]
TOLERANCE_S = 0.05  # 2 shared cores: the event loop may be late by a few ms, never by this much


def prompts_for(reqs: list[TraceRequest]) -> list[str | None]:
    synth = PromptSynth(load_tokenizer("toy"), block_tokens=16)
    return [synth.prompt(r, i) for i, r in enumerate(reqs)]


async def test_open_loop_keeps_the_trace_clock_and_exact_lengths(nats_server) -> None:
    reqs = [TraceRequest(t, 20 + 7 * i, 3 + i % 4, hash_ids=[i % 2]) for i, t in enumerate(ARRIVALS)]
    got = []
    async with toy_stack(nats_server.url, workers=2) as s, make_client(s.base_url) as client:
        recs = await replay(Target(client, "toy"), reqs, prompts_for(reqs), Pacing(), got.append, progress=False)
    assert len(got) == len(reqs) and all(r.ok for r in recs), [r.error for r in recs]
    for r, req in zip(recs, reqs, strict=True):
        assert abs(r.sent_s - req.arrival_s) < TOLERANCE_S, (r.sent_s, req.arrival_s)
        assert r.prompt_tokens == req.input_tokens, "the prompt is exactly the asked length"
        assert r.completion_tokens == req.output_tokens, "the output length is forced"
        assert 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) >= (1 if req.output_tokens > 1 else 0)
    gaps = [b.sent_s - a.sent_s for a, b in zip(recs, recs[1:], strict=False)]
    want = [b - a for a, b in zip(ARRIVALS, ARRIVALS[1:], strict=False)]
    assert all(abs(g - w) < TOLERANCE_S for g, w in zip(gaps, want, strict=True)), (gaps, want)


async def test_max_in_flight_bound_and_closed_loop(nats_server) -> None:
    reqs = [TraceRequest(0.0, 10, 4) for _ in range(6)]
    async with toy_stack(nats_server.url) as s, make_client(s.base_url) as client:
        one = await replay(Target(client, "toy"), reqs, prompts_for(reqs), Pacing(max_in_flight=1), lambda r: None,
                           progress=False)
        two = await replay(Target(client, "toy"), reqs, prompts_for(reqs), Pacing(concurrency=2), lambda r: None,
                           progress=False)
    spans = sorted((r.sent_s, r.done_s) for r in one)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False)), "never two in flight"
    assert all(r.ok for r in one + two)
    events = sorted([(r.sent_s, 1) for r in two] + [(r.done_s, -1) for r in two])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 2


async def test_interrupt_keeps_finished_and_marks_cut_requests(nats_server) -> None:
    reqs = [TraceRequest(0.1 * i, 10, 200) for i in range(10)]  # 200 tokens: still running when cut
    got = []
    async with toy_stack(nats_server.url) as s, make_client(s.base_url) as client:
        task = asyncio.create_task(replay(Target(client, "toy"), reqs, prompts_for(reqs), Pacing(), got.append,
                                          progress=False))
        await asyncio.sleep(0.35)  # mid-trace: some requests done, some running, some not yet sent
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    assert 1 <= len(got) < len(reqs)
    assert any(r.error == "cancelled" for r in got)


async def test_short_replay_writes_jsonl_summary_plots_and_compares(nats_server, tmp_path: Path, capsys) -> None:
    trace = read_trace(AZURE)
    shaping = Shaping(duration_s=8.0, time_scale=4.0, length_scale=0.02, max_output_tokens=8)
    async with toy_stack(nats_server.url, workers=2) as s:
        runs = []
        for name, pacing in (("open", Pacing(max_in_flight=8)), ("closed", Pacing(concurrency=2))):
            lt = LoadTest(s.base_url, tmp_path / name, tokenizer="toy", shaping=shaping, pacing=pacing,
                          progress=False, source={"trace": str(AZURE)})
            runs.append(await asyncio.to_thread(run_loadtest, trace, lt))
    open_run = tmp_path / "open"
    rows = [json.loads(line) for line in (open_run / "requests.jsonl").read_text().splitlines()]
    n = len(shaping.apply(trace))
    assert len(rows) == n > 5 and all(r["status"] == 200 for r in rows)
    assert {"sent_s", "ttft_s", "itl_s", "e2e_s", "prompt_tokens", "completion_tokens", "cached_tokens",
            "error"} <= rows[0].keys()
    summary = json.loads((open_run / "summary.json").read_text())
    assert summary["ok"] == n and summary["req_per_s"] > 0 and summary["ttft_s"]["p99"] is not None
    assert summary["meta"]["shaping"]["time_scale"] == 4.0 and summary["meta"]["model"] == "toy"
    for png in ("latency_cdf.png", "throughput.png", "ttft_over_time.png"):
        assert (open_run / png).stat().st_size > 1000
    assert "scale: time x4.0" in capsys.readouterr().out
    fig = tmp_path / "cmp.png"
    assert main(["loadtest", "compare", str(open_run), str(tmp_path / "closed"), "--out", str(fig)]) == 0
    out = capsys.readouterr().out
    assert "open" in out and "closed" in out and "TTFT p50 ms" in out and fig.stat().st_size > 1000


async def test_cli_run_with_a_scenario_and_flags(nats_server, tmp_path: Path, capsys) -> None:
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"trace": str(AZURE), "duration": 2.0, "length_scale": 0.01,
                                    "max_output_tokens": 4, "tokenizer": "toy", "max_in_flight": 4}))
    async with toy_stack(nats_server.url) as s:
        rc = await asyncio.to_thread(main, ["loadtest", "run", "--scenario", str(scenario), "--url", s.base_url,
                                            "--time-scale", "2", "--out", str(tmp_path / "run"), "--no-progress",
                                            "--no-plots"])
    assert rc == 0
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["shaping"]["time_scale"] == 2.0 and meta["shaping"]["length_scale"] == 0.01
    assert meta["pacing"]["max_in_flight"] == 4 and meta["tokenizer"] == "toy"
    assert "results:" in capsys.readouterr().out


async def test_cli_run_writes_to_the_user_cache_not_the_source_tree(nats_server, tmp_path: Path, capsys,
                                                                     monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # as ./run does: the working directory is the repository
    monkeypatch.delenv("MOEBUS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_results_dir() == tmp_path / "xdg" / "moebus" / "loadtest"
    monkeypatch.setenv("MOEBUS_CACHE", str(tmp_path / "cache"))
    async with toy_stack(nats_server.url) as s:
        rc = await asyncio.to_thread(main, ["loadtest", "run", "--synthetic", "--num-requests", "2", "--rate", "50",
                                            "--input-tokens", "8", "--output-tokens", "2", "--tokenizer", "toy",
                                            "--url", s.base_url, "--name", "r1", "--no-progress", "--no-plots"])
    assert rc == 0
    run = tmp_path / "cache" / "loadtest" / "r1"
    assert json.loads((run / "summary.json").read_text())["ok"] == 2
    assert f"results: {run}" in capsys.readouterr().out
    assert not (tmp_path / "loadtest").exists(), "nothing written under the working directory"


def test_cli_reports_a_bad_trace(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("Timestamp,Request tokens,Response tokens\n1,2,x\n")
    assert main(["loadtest", "run", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
