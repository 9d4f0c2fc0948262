"""`moebus loadtest run|compare|report`: registered on the main CLI by add_cli_commands().

    moebus loadtest run --trace ../shared/traces/azure_code_2023.csv --url http://localhost:8000 \
        --duration 120 --time-scale 2 --length-scale 0.05 --max-in-flight 16
    moebus loadtest run --synthetic --rate 2 --num-requests 60 --input-tokens 256 --output-tokens 32
    moebus loadtest run --scenario loadtest/scenarios/azure_code_cpu.json
    moebus loadtest compare ~/.cache/moebus/loadtest/a ~/.cache/moebus/loadtest/b

Run folders go to --out, else under the user cache (default_results_dir()), never the source tree:
loadtest/results/README.md keeps only a summary of each study's runs and how to make them again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .formats import FORMATS
from .synthetic import DISTRIBUTIONS


def default_results_dir() -> Path:
    """$MOEBUS_CACHE/loadtest, else $XDG_CACHE_HOME/moebus/loadtest, else ~/.cache/moebus/loadtest
    (the cache convention of moebus/kernels/cpu_build.py)."""
    base = os.environ.get("MOEBUS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "moebus")
    return Path(base).expanduser() / "loadtest"


def _run(args: argparse.Namespace) -> int:
    from .formats import read_trace
    from .runner import Pacing
    from .session import LoadTest, run_loadtest
    from .summary import SLO
    from .synthetic import SyntheticSpec, synthetic_trace
    from .trace import Shaping, TraceError

    if args.scenario:
        _apply_scenario(args)
    if bool(args.trace) == bool(args.synthetic):
        print("error: give --trace FILE or --synthetic (not both)", file=sys.stderr)
        return 2
    try:
        if args.trace:
            trace = read_trace(args.trace, args.format)
            source = {"trace": str(args.trace), "format": args.format}
        else:
            spec = SyntheticSpec(args.rate, args.num_requests, args.input_tokens, args.output_tokens,
                                 args.burstiness, args.length_dist, args.seed)
            trace = synthetic_trace(spec)
            source = {"synthetic": {k: getattr(spec, k) for k in spec.__slots__}}
        shaping = Shaping(args.start, args.duration, args.time_scale, args.length_scale, args.max_input_tokens,
                          args.max_output_tokens, args.max_requests, args.output_scale)
        pacing = Pacing(args.max_in_flight, args.concurrency)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(args.trace).stem if args.trace else 'synthetic'}"
    out = (Path(args.out) if args.out else default_results_dir() / name).absolute()
    print(f"results go to {out}", flush=True)
    lt = LoadTest(args.url, out, args.model, args.api_key, args.tokenizer, shaping, pacing,
                  SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000), args.shared_prefix_tokens, args.prompt_seed,
                  args.timeout, not args.no_progress, not args.no_plots, source)
    run_loadtest(trace, lt)
    print(f"results: {out}")
    return 0


def _apply_scenario(args: argparse.Namespace) -> None:
    """A scenario file (JSON of option names -> values) fills the options not given on the command line."""
    parser: argparse.ArgumentParser = args._parser
    scenario = json.loads(Path(args.scenario).read_text())
    for key, value in scenario.items():
        dest = key.replace("-", "_")
        if not hasattr(args, dest) or dest.startswith("_"):
            raise SystemExit(f"error: {args.scenario}: unknown option {key!r}")
        if getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)


def _compare(args: argparse.Namespace) -> int:
    from .compare import compare

    print(compare([Path(d) for d in args.runs], Path(args.out) if args.out else None, not args.no_plots))
    return 0


def _report(args: argparse.Namespace) -> int:
    from .session import finish
    from .summary import SLO

    slo = None
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        slo = SLO((args.slo_ttft_ms or 2000.0) / 1000, (args.slo_itl_ms or 200.0) / 1000)
    finish(Path(args.run), slo, plots=not args.no_plots)
    return 0


def add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    lt = subparsers.add_parser("loadtest", help="replay a traffic trace against an OpenAI-compatible endpoint")
    sub = lt.add_subparsers(dest="loadtest_command", required=True)
    r = sub.add_parser("run", help="replay a trace (or synthetic arrivals); write requests.jsonl, summary, plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--scenario", help="JSON file of option values (loadtest/scenarios/); flags given win")
    src = r.add_argument_group("source")
    src.add_argument("--trace", help="trace file (Mooncake JSONL, Azure CSV, BurstGPT CSV, aiperf JSONL)")
    src.add_argument("--format", default="auto", choices=("auto", *FORMATS))
    src.add_argument("--synthetic", action="store_true", help="gamma/Poisson arrivals instead of a trace")
    src.add_argument("--rate", type=float, default=1.0, help="synthetic: requests per second")
    src.add_argument("--num-requests", type=int, default=100)
    src.add_argument("--input-tokens", type=int, default=256, help="synthetic: mean prompt length")
    src.add_argument("--output-tokens", type=int, default=64, help="synthetic: mean output length")
    src.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    src.add_argument("--length-dist", choices=DISTRIBUTIONS, default="fixed")
    tgt = r.add_argument_group("target")
    tgt.add_argument("--url", default="http://127.0.0.1:8000")
    tgt.add_argument("--model", default=None, help="default: the endpoint's first model")
    tgt.add_argument("--api-key", default="none")
    tgt.add_argument("--tokenizer", default="smollm2",
                     help='prompt tokenizer: "smollm2", "toy", a .gguf file or an HF dir with tokenizer.json')
    tgt.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    sh = r.add_argument_group("shaping (the report states it)")
    sh.add_argument("--start", type=float, default=0.0, help="window start, trace seconds")
    sh.add_argument("--duration", type=float, default=None, help="window length, trace seconds")
    sh.add_argument("--time-scale", type=float, default=1.0, help="speed-up: 2 replays twice as fast")
    sh.add_argument("--length-scale", type=float, default=1.0, help="multiply input/output lengths (and blocks)")
    sh.add_argument("--output-scale", type=float, default=None, help="output lengths only (default: --length-scale)")
    sh.add_argument("--max-input-tokens", type=int, default=None)
    sh.add_argument("--max-output-tokens", type=int, default=None)
    sh.add_argument("--max-requests", type=int, default=None)
    sh.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="a prefix common to every synthesised prompt (traces have no sharing otherwise)")
    sh.add_argument("--seed", type=int, default=0, help="synthetic arrivals and lengths")
    sh.add_argument("--prompt-seed", type=int, default=None,
                    help="prompt text (default: fresh per run, so reruns do not hit the previous run's cache)")
    pc = r.add_argument_group("pacing")
    pc.add_argument("--max-in-flight", type=int, default=None, help="open loop: bound on requests in flight")
    pc.add_argument("--concurrency", type=int, default=None, help="closed loop: this many users, no trace clock")
    out = r.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    out.add_argument("--slo-itl-ms", type=float, default=200.0)
    out.add_argument("--out", default=None, help="run folder (default: $MOEBUS_CACHE/loadtest/<time>-<trace>, "
                     "else $XDG_CACHE_HOME/moebus/loadtest/..., else ~/.cache/moebus/loadtest/...)")
    out.add_argument("--name", default=None, help="run folder name under the default results folder")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--no-plots", action="store_true")
    r.set_defaults(func=_run, _parser=r)

    c = sub.add_parser("compare", help="runs side by side: one table, one figure")
    c.add_argument("runs", nargs="+", help="run folders")
    c.add_argument("--out", default=None, help="figure path (default: compare.png beside the first run)")
    c.add_argument("--no-plots", action="store_true")
    c.set_defaults(func=_compare)

    p = sub.add_parser("report", help="rebuild a run folder's summary and plots (e.g. under another SLO)")
    p.add_argument("run")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-itl-ms", type=float, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=_report)
