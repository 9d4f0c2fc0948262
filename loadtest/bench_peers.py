"""moebus vs vLLM (CPU) vs llama.cpp on the same machine, same weights, same client (issue #21).

Installs nothing: the peers come from loadtest/peers/ (setup_*.sh made the venvs, the HF copy and
the F32 GGUF; serve_<server>.sh starts each). Per round, each server in turn (the order rotates
every round) is started fresh, warmed up, then driven at every concurrency by this one client
(moebus's own load-test client, `moebus.loadtest.client.send`: the `openai` SDK, streamed
completions, max_tokens = min_tokens = output, ignore_eos, greedy unless --temperature) with prompts of exactly
--prompt-len tokens (new random text per request: no prefix-cache hits), closed loop.

"engine" is moebus's engine in-process (a child process, same threads, same prompt ids) at the
same concurrency: the stack's overhead is its tok/s over the stack's (target 3). With --spans the
moebus stack writes its trace spans and the c=1 TTFT is split into HTTP in, tokenizer, balancer,
worker queue, the engine step that made the first token, and the way back to the client.

    flock /tmp/moebus-bench.lock .venv/bin/python loadtest/bench_peers.py --rounds 2 --concurrency 1,16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / "loadtest" / "peers"
PORTS = {"moebus": 8401, "vllm": 8402, "llamacpp": 8403, "moebus-1w": 8404, "moebus-dp2": 8405}
# moebus configurations besides the default (`moebus up --workers auto`: two workers sharing the
# cores where there are 2+ cores and memory for them, services/fleet_shape.py), run by
# serve_moebus.sh with these `moebus up` flags. moebus-1w: one worker with every core's thread (the
# default before 2026-12-05). moebus-dp2: two workers of one thread each on 2 cores (a fixed split:
# no OpenMP barrier between the cores, so another process on one core stalls only that worker),
# each with half the burst step budget.
VARIANTS = {"moebus-1w": ["--workers", "1"],
            "moebus-dp2": ["--workers", "2", "--torch-threads", "1",
                           "--engine", json.dumps({"burst_step_tokens": 768})]}
MODEL = "smollm2"


@dataclass
class Run:
    server: str
    round: int
    concurrency: int
    requests: int = 0
    ok: int = 0
    tok_s: float = 0.0
    tpot_ms: float = 0.0  # median over requests of (e2e - ttft) / (tokens - 1)
    ttft_ms: float = 0.0  # median
    prompt_tokens: float | None = None  # mean reported by the server (fairness check)
    completion_tokens: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)  # os.getloadavg() just before
    errors: list[str] = field(default_factory=list)
    ttft_split_ms: dict[str, float] = field(default_factory=dict)  # c=1 moebus with --spans


# ---- prompts ----------------------------------------------------------------------------------

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

class Server:
    def __init__(self, name: str, log: Path, dtype: str, spans: Path | None, threads: int,
                 variants: dict[str, list[str]], port: int) -> None:
        """variants: `moebus up` flags of each moebus configuration besides the default."""
        self.name, self.port, self.log = name, port, log
        script = "moebus" if name in variants else name
        args = ["bash", str(PEERS_DIR / f"serve_{script}.sh"), str(self.port), *variants.get(name, [])]
        if name == "moebus" and spans is not None:
            args += ["--trace-file", str(spans)]
        env = {**os.environ, "DTYPE": dtype, "THREADS": str(threads)}
        self.f = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self.f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 900) -> float:
        """Until a completion answers (/v1/models can answer before a worker registers)."""
        t0 = time.monotonic()
        body = json.dumps({"model": MODEL, "prompt": "Warm-up: the quick brown fox", "max_tokens": 8}).encode()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                req = urllib.request.Request(self.url + "/v1/completions", body, {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s; see {self.log}")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.f.close()


# ---- the client -------------------------------------------------------------------------------

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


def summarize(run: Run, recs: list, wall: float) -> None:
    ok = [r for r in recs if r.ok]
    run.requests, run.ok = len(recs), len(ok)
    run.errors = sorted({(r.error or str(r.status))[:120] for r in recs if not r.ok})
    run.completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    run.tok_s = run.completion_tokens / wall
    if ok:
        run.ttft_ms = 1000 * statistics.median(r.ttft_s for r in ok if r.ttft_s is not None)
        run.tpot_ms = 1000 * statistics.median((r.e2e_s - r.ttft_s) / max(1, (r.completion_tokens or 2) - 1)
                                               for r in ok if r.ttft_s is not None)
        counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        run.prompt_tokens = statistics.mean(counts) if counts else None


# ---- the in-process engine (child process) ----------------------------------------------------

def engine_burst(eng, prompts: list[list[int]], concurrency: int, params) -> dict:
    """Closed loop on an in-process engine: at most `concurrency` requests in flight, each new one
    added as one finishes (all at once when there are no more prompts than that). tok/s, and the
    medians of TTFT and TPOT over requests."""
    pending = list(enumerate(prompts))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    tokens = 0
    t0 = time.perf_counter()
    while pending or len(done) < len(prompts):
        while pending and len(sent) - len(done) < concurrency:
            i, p = pending.pop(0)
            rid = f"b{t0:.6f}-{i}"
            eng.add_request(rid, p, params)
            sent[rid] = time.perf_counter()
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
            "tpot_ms": 1000 * statistics.median((done[r][0] - first[r]) / max(1, done[r][1] - 1) for r in sent)}


def engine_child(spec: dict) -> dict:
    import torch

    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    torch.set_num_threads(spec["threads"])
    eng = LLMEngine(EngineConfig(model=MODEL, dtype=spec["dtype"], **spec.get("engine", {})))
    out_len = spec["output_len"]
    params = SamplingParams(temperature=spec["temperature"], max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
    eng.add_request("warm", spec["warmup"], SamplingParams(temperature=0, max_tokens=16, min_tokens=16,
                                                           ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    return {c: engine_burst(eng, prompts, int(c), params) for c, prompts in spec["runs"].items()}


def run_engine(threads: int, dtype: str, output_len: int, prompt_ids: dict[int, list[list[int]]],
               warmup: list[int], log: Path, temperature: float = 0.0, engine: dict | None = None) -> dict:
    """engine: extra EngineConfig fields for the child (--engine-json)."""
    spec = {"threads": threads, "dtype": dtype, "output_len": output_len, "warmup": warmup, "temperature": temperature,
            "engine": engine or {}, "runs": {str(c): p for c, p in prompt_ids.items()}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    with open(log, "wb") as lf:
        out = subprocess.run([sys.executable, __file__, "--engine-child", f.name], stdout=subprocess.PIPE,
                             stderr=lf, cwd=REPO, check=True)
    os.unlink(f.name)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


# ---- moebus's spans: the c=1 TTFT split -------------------------------------------------------

def ttft_split(spans_file: Path, recs: list) -> dict[str, float]:
    """Median ms of each leg of the c=1 TTFT (moebus/loadtest/ttft_split.py): engine_step is the
    engine's work (the step that made the first token); every other leg is the stack's overhead."""
    from moebus.loadtest.ttft_split import medians, split_all
    from moebus.shared.trace_view import read_spans

    return medians(split_all(read_spans(str(spans_file)), recs))


# ---- the table --------------------------------------------------------------------------------

def cpu_summary() -> str:
    from moebus.engine.dtype_choice import choose_dtype, cpu_flags, shown_flags

    model = "?"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = cpu_flags()
    return (f"CPU: {model}, {os.cpu_count()} logical cores; flags: {' '.join(shown_flags(flags))}; "
            f"dtype auto would pick {choose_dtype('auto', 'cpu', flags).dtype}")


def _med(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.1f}" if len(xs) == 1 else f"{m:.1f} ({min(xs):.1f}-{max(xs):.1f})"


def table(runs: list[Run], servers: list[str], concurrencies: list[int], ref: str = "moebus") -> str:
    """One row per server and concurrency; the ratios are `ref`'s over that server's."""
    lines = ["| c | server | tok/s | TPOT ms | TTFT p50 ms | ok/requests | load avg 1m | "
             f"tok/s ratio {ref}/server | TPOT ratio | TTFT ratio |",
             "| ---: | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for c in concurrencies:
        med: dict[str, dict[str, float]] = {}
        for s in servers:
            rs = [r for r in runs if r.server == s and r.concurrency == c]
            if rs:
                med[s] = {k: statistics.median(getattr(r, k) for r in rs) for k in ("tok_s", "tpot_ms", "ttft_ms")}
        for s in servers:
            rs = [r for r in runs if r.server == s and r.concurrency == c]
            if not rs:
                continue
            m, mb = med[s], med.get(ref)
            ratios = ["-", "-", "-"]
            if mb and s != ref and m["tok_s"] > 0:
                ratios = [f"{mb['tok_s'] / m['tok_s']:.2f}", f"{mb['tpot_ms'] / m['tpot_ms']:.2f}",
                          f"{mb['ttft_ms'] / m['ttft_ms']:.2f}"]
            ok = f"{sum(r.ok for r in rs)}/{sum(r.requests for r in rs)}" if s != "engine" else "-"
            lines.append(f"| {c} | {s} | {_med([r.tok_s for r in rs])} | {_med([r.tpot_ms for r in rs])} | "
                         f"{_med([r.ttft_ms for r in rs])} | {ok} | "
                         f"{', '.join(f'{r.load[0]:.1f}' for r in rs)} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="moebus,vllm,llamacpp,engine",
                    help="comma list of moebus, vllm, llamacpp, engine (in-process moebus engine), "
                         f"and moebus configurations: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-user", type=int, default=2, help="requests = max(concurrency x this, --min-requests)")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="moebus and vLLM compute dtype (llama.cpp: the F32 GGUF)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy; 1: the API's default)")
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
    variants = dict(VARIANTS)
    ports = dict(PORTS)
    for i, v in enumerate(args.variant):
        name, sep, flags = v.partition("=")
        if not sep or not name or name in PORTS:
            ap.error(f"--variant {v!r}: want NAME=FLAGS with a new NAME")
        variants[name], ports[name] = shlex.split(flags), 8410 + i
    servers = [s for s in args.servers.split(",") if s]
    for s in servers:
        if s not in (*ports, "engine"):
            ap.error(f"unknown server {s}")
    concs = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    print(cpu_summary(), flush=True)
    prompts = {c: make_prompts(max(c * args.requests_per_user, args.min_requests), args.prompt_len, f"c{c}")
               for c in concs}
    warm_text, warm_ids = make_prompts(1, args.prompt_len, "warm")
    runs: list[Run] = []
    for rnd in range(1, args.rounds + 1):
        order = servers[(rnd - 1) % len(servers):] + servers[:(rnd - 1) % len(servers)]
        for s in order:
            print(f"== round {rnd}: {s}", flush=True)
            if s == "engine":
                load = os.getloadavg()
                res = run_engine(args.threads, args.dtype, args.output_len, {c: prompts[c][1] for c in concs},
                                 warm_ids[0], out / f"engine-{rnd}.log", args.temperature,
                                 json.loads(args.engine_json))
                for c in concs:
                    r = res[str(c)]
                    runs.append(Run("engine", rnd, c, tok_s=r["tok_s"], tpot_ms=r["tpot_ms"], ttft_ms=r["ttft_ms"],
                                    completion_tokens=r["completion_tokens"], load=load))
                    print(f"   c={c}: {r['tok_s']:.1f} tok/s, TPOT {r['tpot_ms']:.1f} ms, TTFT {r['ttft_ms']:.0f} ms",
                          flush=True)
                continue
            spans = out / f"spans-{rnd}.jsonl" if s == "moebus" and args.spans else None
            srv = Server(s, out / f"{s}-{rnd}.log", args.dtype, spans, args.threads, variants, ports[s])
            try:
                try:
                    ready = srv.wait_ready()
                except RuntimeError as e:  # one peer that does not start must not lose the others' runs
                    print(f"   {e}", flush=True)
                    continue
                print(f"   ready after {ready:.0f} s", flush=True)
                asyncio.run(drive(srv.url, warm_text, 1, 16))
                for c in concs:
                    run = Run(s, rnd, c, load=os.getloadavg())
                    recs, wall = asyncio.run(drive(srv.url, prompts[c][0], c, args.output_len, args.temperature))
                    summarize(run, recs, wall)
                    if spans is not None and c == 1:
                        time.sleep(6)  # the span exporters flush every 5 s
                        run.ttft_split_ms = ttft_split(spans, recs)
                    runs.append(run)
                    print(f"   c={c}: {run.ok}/{run.requests} ok, {run.tok_s:.1f} tok/s, TPOT {run.tpot_ms:.1f} ms, "
                          f"TTFT {run.ttft_ms:.0f} ms, prompt tokens {run.prompt_tokens}, load {run.load[0]:.2f}"
                          + (f", errors {run.errors}" if run.errors else ""), flush=True)
            finally:
                srv.stop()
            time.sleep(3)
        (out / "runs.json").write_text(json.dumps([r.__dict__ for r in runs], indent=1))
        print(f"-- after round {rnd}:\n" + table(runs, servers, concs), flush=True)
    print()
    print(cpu_summary())
    print(f"prompt {args.prompt_len} / output {args.output_len} tokens, {'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}, ignore_eos, {args.rounds} rounds "
          f"(order rotated), dtype {args.dtype}, {args.threads} threads per server; medians (min-max) over rounds")
    print(table(runs, servers, concs))
    for ref in (s for s in servers if s in variants):
        print(f"\nthe same, ratios of {ref}:\n" + table(runs, servers, concs, ref))
    if "engine" in servers and "moebus" in servers:
        print("\nstack overhead (engine in-process tok/s / moebus stack tok/s, per round):")
        for c in concs:
            ratios = []
            for rnd in range(1, args.rounds + 1):
                e = [r for r in runs if r.server == "engine" and r.round == rnd and r.concurrency == c]
                m = [r for r in runs if r.server == "moebus" and r.round == rnd and r.concurrency == c]
                if e and m and m[0].tok_s:
                    ratios.append(e[0].tok_s / m[0].tok_s)
            print(f"  c={c}: {', '.join(f'{x:.3f}' for x in ratios)}")
    splits = [r.ttft_split_ms for r in runs if r.ttft_split_ms]
    if splits:
        print("\nmoebus c=1 TTFT split (ms, median over requests, per round):")
        for k in splits[0]:
            print(f"  {k:28s} " + "  ".join(f"{s.get(k, float('nan')):8.1f}" for s in splits))
    print(f"\nper-run JSON and logs: {out}; load averages now: {os.getloadavg()}")


if __name__ == "__main__":
    main()
