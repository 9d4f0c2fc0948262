"""GPU readiness: is this CUDA machine fit to serve? One run, under 10 minutes on one GPU.

    .venv/bin/python loadtest/gpu_readiness.py --out /tmp/readiness          # a CUDA machine
    .venv/bin/python loadtest/gpu_readiness.py --device cpu --quick          # CI: Triton's interpreter

1. kernels: every Triton kernel of moebus.kernels against its torch reference on the device, at
   model-sized shapes, with the inputs and tolerances of tests/kernels (gpu_readiness_kernels.py);
   max abs / rel error per case, and any `<op>_triton` left without a case is a failure.
2. parity: the engine fp32 on the device against HF transformers fp32 on the same weights, SmolLM2
   and the tiny DeepSeek-V4 checkpoint (gpu_readiness_engine.py, through moebus.eval).
3. throughput: in-process engine decode tok/s (LLMEngine.step, no HTTP) on SmolLM2 at batch 1, 16
   and 64, greedy, EOS ignored.

--device cpu runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (set here, before
anything imports triton) and the engine on CPU. Writes gpu_readiness.json and summary.txt to --out
(default $OUT, else a new temporary directory). Exit 0: every check passed; 1: one failed; 2: this
machine cannot run it (no CUDA device for --device cuda, no triton, kernels not interpreted).
Needs the dev extras (pytest, triton): the kernel cases come from the test modules.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCHES = (1, 16, 64)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: Triton kernels under TRITON_INTERPRET=1, engine on CPU (default cuda)")
    ap.add_argument("--quick", action="store_true", help="small shapes, short runs (CI)")
    ap.add_argument("--out", type=Path, default=None, help="result directory (default $OUT, else a temp dir)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-hf", action="store_true", help="no HF parity rows")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=list(BATCHES))
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (quick: 16)")
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (quick: 4); at least 2")
    ap.add_argument("--dtype", default="auto", help="throughput dtype (auto: bf16 where the device has it)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.output_len = args.output_len or (4 if args.quick else 64)
    if args.output_len < 2:
        ap.error("--output-len must be >= 2: decode starts after the first token")
    return args


def prepare_device(device: str, need_triton: bool) -> str | None:
    """Set up Triton's mode for the device; the reason this machine cannot run the script, or None."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: before torch and moebus
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # e.g. inherited from a test run: kernels would not compile
    import torch

    from moebus.kernels._compat import HAS_TRITON, interpreting

    if device == "cuda" and not torch.cuda.is_available():
        return (f"--device cuda, but torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA "
                f"device; run it on a GPU machine, or with --device cpu for the interpreter run")
    if need_triton and not HAS_TRITON:
        return "triton is not installed (pip install triton, or the dev extras); --skip-kernels runs the rest"
    if need_triton and device == "cpu" and not interpreting():
        return "triton was imported before TRITON_INTERPRET=1 was set: the kernels would compile, not interpret"
    if device == "cuda":  # exact float32 references: no TF32 whatever the environment says
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return None


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    from moebus.kernels._compat import HAS_TRITON, interpreting

    env = {"device": device, "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
           "triton": __import__("triton").__version__ if HAS_TRITON else None, "triton_interpreted": interpreting()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    return env


def failures(report: dict[str, Any]) -> list[str]:
    """One line per failed check; empty: ready."""
    out = [f"kernel {r['kernel']} [{r['case']}]: {r.get('error') or str(r['mismatches']) + ' elements outside tolerance'}"
           for r in report["kernels"] if not r["ok"]]
    out += [f"kernel {name}: no case in gpu_readiness_kernels.py" for name in report["uncovered"]]
    out += [f"parity {r['model']}: {r.get('error') or [k for k, ok in r['checks'].items() if not ok] or 'short output'}"
            for r in report["parity"] if not r["ok"]]
    out += [f"throughput batch {r.get('batch')}: {r.get('error') or 'no decode tokens'}"
            for r in report["throughput"] if not r["ok"]]
    return out


def _num(v: Any, fmt: str = ".2e") -> str:
    return format(v, fmt) if isinstance(v, float | int) else str(v)


def summary(report: dict[str, Any]) -> str:
    env = report["env"]
    what = env.get("gpu") or ("CPU, Triton interpreted" if env.get("triton_interpreted") else "CPU")
    lines = [f"gpu_readiness: {'READY' if report['ok'] else 'NOT READY'} on {env['device']} ({what}); torch "
             f"{env['torch']}, triton {env['triton']}, transformers {env['transformers']}"
             f"{', quick' if report['quick'] else ''}; {report['seconds']:.0f} s"]
    if report["kernels"]:
        w = max(len(r["case"]) for r in report["kernels"])
        lines += [f"\nkernels: Triton vs torch reference ({len(report['kernels'])} cases)",
                  f"  {'kernel':30s} {'case':{w}s} {'max abs':>9s} {'max rel':>9s} {'tol used':>8s} result"]
        for r in report["kernels"]:
            used = "exact" if r.get("atol") == r.get("rtol") == 0 else _num(r.get("tol_used"), ".2f")
            lines.append(f"  {r['kernel']:30s} {r['case']:{w}s} {_num(r.get('max_abs')):>9s} "
                         f"{_num(r.get('max_rel')):>9s} {used:>8s} {'ok' if r['ok'] else 'FAIL'}")
    if report["parity"]:
        lines += ["\nparity: engine fp32 on the device vs HF transformers fp32 (CPU), same weights",
                  f"  {'model':10s} {'KL':>9s} {'same top':>9s} {'PPL ratio':>10s} {'greedy matched':>15s} "
                  f"{'ties':>5s} result"]
        for r in report["parity"]:
            if "error" in r:
                lines.append(f"  {r['model']:10s} FAIL: {r['error']}")
                continue
            lines.append(f"  {r['model']:10s} {r['kl']:9.2e} {r['same_top_pct']:8.1f}% {r['ppl_ratio']:10.6f} "
                         f"{r['greedy_matched']:>7d}/{r['prompts']} x{r['greedy_tokens']:<4d} {r['ties']:5d} "
                         f"{'ok' if r['ok'] else 'FAIL ' + str(r['real_divergences'])}")
    if report["throughput"]:
        first = report["throughput"][0]
        lines += [f"\nthroughput: in-process engine decode (LLMEngine.step, no HTTP), {first.get('model')} "
                  f"{first.get('dtype')}, prompt {first.get('prompt_len')}, {first.get('output_len')} greedy "
                  f"tokens, EOS ignored",
                  f"  {'batch':>5s} {'decode tok/s':>12s} {'step ms':>8s} {'prefill s':>9s}"]
        for r in report["throughput"]:
            lines.append(f"  FAIL: {r['error']}" if "error" in r else
                         f"  {r['batch']:5d} {r['decode_tok_s']:12.1f} {r['step_ms']:8.2f} {r['prefill_s']:9.3f}")
    if report["failures"]:
        lines += ["\nfailures:", *(f"  {f}" for f in report["failures"])]
    return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    """NaN and inf as strings: JSON has neither."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return [_jsonable(x) for x in v] if isinstance(v, list | tuple) else v


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(HERE))  # the sibling modules (loadtest/ is not a package)
    import gpu_readiness_engine as engine
    import gpu_readiness_kernels as kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"quick": args.quick, "env": environment(args.device), "kernels": [], "uncovered": [],
                              "parity": [], "throughput": [], "section_seconds": {}}

    def section(name: str, fn: Any) -> None:
        start = time.perf_counter()
        print(f"[{name}]", flush=True)
        fn()
        report["section_seconds"][name] = round(time.perf_counter() - start, 1)
        if args.device == "cuda":
            torch.cuda.empty_cache()

    def check_kernels() -> None:
        report["kernels"], report["uncovered"] = kernels.check_kernels(
            args.device, args.quick, lambda line: print(line, flush=True))

    def check_parity() -> None:
        for model in engine.PARITY:
            try:
                report["parity"].append(engine.parity(model, args.device, args.quick))
            except Exception as e:  # noqa: BLE001 - a failed row; the other model still runs
                report["parity"].append({"model": model, "ok": False, "error": _error(e)})

    def measure_throughput() -> None:
        try:
            report["throughput"] = engine.throughput(args.device, args.batches, args.prompt_len, args.output_len,
                                                     args.dtype)
        except Exception as e:  # noqa: BLE001 - reported as a failed row
            report["throughput"] = [{"ok": False, "error": _error(e)}]

    for name, fn, skip in (("kernels", check_kernels, args.skip_kernels), ("parity", check_parity, args.skip_hf),
                           ("throughput", measure_throughput, args.skip_throughput)):
        if not skip:
            section(name, fn)
    report["failures"] = failures(report)
    report["ok"] = not report["failures"]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = prepare_device(args.device, need_triton=not args.skip_kernels)
    if reason:
        print(f"gpu_readiness: {reason}", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-readiness-"))
    out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    text = summary(report)
    (out / "gpu_readiness.json").write_text(json.dumps(_jsonable(report), indent=1, allow_nan=False) + "\n")
    (out / "summary.txt").write_text(text + "\n")
    print(f"\n{text}\n\nwritten: {out / 'gpu_readiness.json'}, {out / 'summary.txt'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
