"""One load test end to end: shape the trace, build the prompts, replay, then write the summary
and plots into the run folder. `finish` (re)builds summary and plots from a run folder alone."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .client import make_client
from .plots import plot_run
from .prompts import PromptSynth, load_tokenizer
from .results import META, SUMMARY, RecordSink, read_json, read_records, write_json
from .runner import Pacing, Target, replay
from .summary import SLO, summarize, table
from .trace import Shaping, TraceRequest


@dataclass(slots=True)
class LoadTest:
    url: str
    out_dir: Path
    model: str | None = None  # None: the endpoint's first model
    api_key: str = "none"
    tokenizer: str = "smollm2"
    shaping: Shaping = field(default_factory=Shaping)
    pacing: Pacing = field(default_factory=Pacing)
    slo: SLO = field(default_factory=SLO)
    shared_prefix_tokens: int = 0  # a prefix common to every synthesised prompt (traces without hash ids)
    # Seeds the prompt text. None: a fresh one per run, so a rerun against a warm server does not
    # hit the prefix cache left by the previous run (the seed used is in meta.json).
    prompt_seed: int | None = None
    timeout_s: float = 600.0
    progress: bool = True
    plots: bool = True
    source: dict[str, Any] = field(default_factory=dict)  # what the trace was, for the report


def build_prompts(reqs: list[TraceRequest], lt: LoadTest) -> list[str | None]:
    """Literal prompts as given; the others synthesised to their exact token count."""
    if all(r.text is not None or r.messages is not None for r in reqs):
        return [r.text for r in reqs]
    if lt.prompt_seed is None:
        lt.prompt_seed = secrets.randbits(32)
    synth = PromptSynth(load_tokenizer(lt.tokenizer), lt.shaping.block_tokens, lt.prompt_seed,
                        lt.shared_prefix_tokens)
    return [r.text if r.text is not None or r.messages is not None else synth.prompt(r, i)
            for i, r in enumerate(reqs)]


def run_loadtest(trace: list[TraceRequest], lt: LoadTest) -> dict[str, Any]:
    """Replay `trace` (unshaped) against lt.url; returns the summary (also written and printed).
    Ctrl-C stops sending and still writes what finished."""
    reqs = lt.shaping.apply(trace)
    if not reqs:
        raise ValueError("no request in the chosen window")
    prompts = build_prompts(reqs, lt)
    meta = {"url": lt.url, "model": lt.model, "tokenizer": lt.tokenizer, "source": lt.source,
            "shaping": lt.shaping.describe(), "pacing": asdict(lt.pacing), "prompt_seed": lt.prompt_seed,
            "shared_prefix_tokens": lt.shared_prefix_tokens, "requests_planned": len(reqs),
            "trace_span_s": reqs[-1].arrival_s, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lt.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(lt.out_dir / META, meta)
    sink = RecordSink(lt.out_dir)
    try:
        meta["model"] = asyncio.run(_replay(reqs, prompts, lt, sink))
    except KeyboardInterrupt:
        meta["interrupted"] = True
    finally:
        sink.close()
    write_json(lt.out_dir / META, meta)
    return finish(lt.out_dir, lt.slo, plots=lt.plots)


async def _replay(reqs: list[TraceRequest], prompts: list[str | None], lt: LoadTest, sink: RecordSink) -> str:
    async with make_client(lt.url, lt.api_key, lt.timeout_s) as client:
        model = lt.model
        if model is None:
            model = (await client.models.list()).data[0].id
        await replay(Target(client, model), reqs, prompts, lt.pacing, sink, lt.progress)
        return model


def finish(run_dir: Path, slo: SLO | None = None, plots: bool = True, echo: bool = True) -> dict[str, Any]:
    """summary.json (+ plots) from a run folder's records; prints the table."""
    meta = read_json(run_dir / META) if (run_dir / META).exists() else {}
    if slo is None:
        old = read_json(run_dir / SUMMARY)["slo"] if (run_dir / SUMMARY).exists() else {}
        slo = SLO(**old)
    records = read_records(run_dir)
    summary = summarize(records, slo, meta)
    write_json(run_dir / SUMMARY, summary)
    if plots and records:
        plot_run(records, run_dir, run_dir.name)
    if echo:
        print(table({run_dir.name: summary}))
        if meta.get("interrupted"):
            print(f"interrupted: {len(records)} of {meta.get('requests_planned')} requests recorded")
        if sh := meta.get("shaping", {}):
            print(shaping_line(sh))
    return summary


def shaping_line(sh: dict[str, Any]) -> str:
    """The report's closing line: how the trace was fitted (Shaping.describe()), in trace seconds."""
    out = sh.get("output_scale")
    start, duration = sh["start_s"], sh["duration_s"]
    if duration is not None:
        window = f"window {start} s + {duration} s"
    else:
        window = "window: the whole trace" if not start else f"window {start} s to the trace's end"
    return (f"scale: time x{sh['time_scale']} (speed-up), lengths x{sh['length_scale']} "
            f"{'' if out is None else f'(outputs x{out}) '}"
            f"(caps in {sh['max_input_tokens']} / out {sh['max_output_tokens']}), {window}")
