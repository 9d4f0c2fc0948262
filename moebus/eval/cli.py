"""`moebus eval`: engine configurations against HF transformers fp32 on the same weights.

    moebus eval                                  # fp32 and bf16 (and the hf-bf16 yardstick)
    moebus eval --config gguf16 --config gguf8 --max-chunks 1 --json eval.json
    moebus eval --model tiny-v4 --config v4 --config v4-mtp --config v4-ep2
    moebus eval --config disagg --config disagg-bf16 --max-chunks 1

Per configuration: perplexity, KL(HF fp32 || engine) and same-top-token % over a fixed English
text (llama-perplexity's --kl-divergence), scored through decode-sized steps; and greedy agreement
on a prompt set, where a first divergence at which HF fp32 itself prefers its token by less than
--tie-margin counts as a tie. HF bf16 is always measured too: the yardstick for the engine's bf16.

`--model tiny-v4` writes a tiny random DeepSeek-V4 (seed 0, one MTP layer) into a temp dir and
uses seeded synthetic token ids as text and prompts (its tokenizer spells token i as `<i>`); the
v4, v4-mtp and v4-ep2 rows need it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moebus.eval.configs import CONFIGS, DEFAULT, HF_BF16, NAMES, TINY_V4
from moebus.eval.text import DEFAULT_PROMPTS, DEFAULT_TEXT


def _eval(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys([HF_BF16, *(args.config or DEFAULT)]))  # the yardstick first, no repeats
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        return _error(f"unknown config {unknown[0]!r} (known: {', '.join(NAMES)})")
    wrong = [n for n in names if n in CONFIGS and CONFIGS[n].model not in (None, args.model)]
    if wrong:
        return _error(f"config {wrong[0]!r} needs --model {CONFIGS[wrong[0]].model}")
    from moebus.eval.report import config_table, summary_table, to_json
    from moebus.eval.run import EvalError, Settings, prepare, run_configs
    from moebus.eval.synthetic import describe
    from moebus.eval.tiny_v4 import resolved

    s = Settings(args.model, Path(args.text), Path(args.prompts), args.ctx, args.max_chunks, args.max_prompts,
                 args.max_tokens, args.tie_margin)
    results = []
    try:
        with resolved(s) as s:
            t0 = time.perf_counter()
            ref, hf_path = prepare(s)
            print(f"HF fp32 reference ({hf_path}): {len(ref.chunks)} chunks, {len(ref.prompts)} prompts "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            if s.synthetic:
                print(describe(sum(len(c.tokens) for c in ref.chunks), len(ref.prompts)))
            print(flush=True)
            for r in run_configs(s, ref, hf_path, names):
                results.append(r)
                print(config_table(r, ref, s) + "\n", flush=True)
    except EvalError as e:
        return _error(str(e))
    print(summary_table(results, ref))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results, ref, s), indent=1) + "\n")
    return 0


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def add_cli_command(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser("eval", help="quality gate: PPL / KL / greedy agreement against HF fp32",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--model", default="smollm2",
                   help=f"smollm2 (embedded), {TINY_V4} (a tiny random DeepSeek-V4 on synthetic token ids), "
                        "a .gguf file or an HF-layout dir")
    e.add_argument("--config", action="append", metavar="NAME",
                   help=f"repeatable; default {','.join(DEFAULT)}; one of: {', '.join(NAMES)}. "
                        + "; ".join(f"{c.name}: {c.description}" for c in CONFIGS.values()))
    e.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="UTF-8 text to score (leading '#' lines are a header, skipped); default: the "
                        "Declaration of Independence and the Gettysburg Address")
    e.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="one chat prompt per line")
    e.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    e.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt")
    e.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half is scored")
    e.add_argument("--max-chunks", type=int, default=None, help="score at most N chunks (quick runs)")
    e.add_argument("--tie-margin", type=float, default=0.01,
                   help="a first divergence where HF fp32's logit margin is below this is a tie")
    e.add_argument("--json", default=None, metavar="FILE", help="also write all results as JSON")
    e.set_defaults(func=_eval)
