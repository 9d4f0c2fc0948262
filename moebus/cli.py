"""`moebus` command line: generate (offline engine), up / serve / keys / status (services), loadtest, trace, eval."""
from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from moebus.engine.llm import LLM
    from moebus.engine.sampling import SamplingParams

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("error: give --prompt or --prompts-file", file=sys.stderr)
        return 2
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.speculative_tokens,
              speculative_method=args.speculative_method, dtype=args.dtype, weight_format=args.weight_format)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    t0 = time.perf_counter()
    if args.raw:
        results = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    else:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    dt = time.perf_counter() - t0
    n_out = 0
    for p, r in zip(prompts, results, strict=True):
        for c in r.outputs:
            n_out += len(c.token_ids)
            print(c.text if len(prompts) == 1 else f"[{p}] -> {c.text}")
    print(f"({n_out} tokens in {dt:.2f}s, {n_out / max(dt, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from moebus import __version__

    parser = argparse.ArgumentParser(prog="moebus", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moebus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run the engine offline on prompts (chat template applied)")
    g.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    g.add_argument("--prompts-file", help="one prompt per line")
    g.add_argument("--model", default="smollm2")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--speculative-tokens", type=int, default=0, help="draft tokens per step")
    g.add_argument("--speculative-method", choices=("ngram", "mtp"), default="ngram",
                   help="mtp: a DeepSeek-V4 checkpoint's next-n prediction layer drafts")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 where the CPU has AVX512-BF16 or AMX, else float32")
    g.add_argument("--weight-format", choices=("auto", "dense", "gguf"), default="auto",
                   help="auto: a GGUF's own blocks on AVX-512 CPUs for dtype auto, else dense "
                        "(moebus/platforms/format_choice.py)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_generate)
    import importlib.util

    if importlib.util.find_spec("moebus.services.cli") is not None:
        from moebus.services.cli import add_cli_commands

        add_cli_commands(sub)
    from moebus.eval.cli import add_cli_command as add_eval
    from moebus.loadtest.cli import add_cli_commands as add_loadtest
    from moebus.shared.trace_view import add_cli_command as add_trace

    add_loadtest(sub)
    add_trace(sub)
    add_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
