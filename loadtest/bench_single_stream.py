"""Single-stream decode latency (c=1 TPOT) on the same GGUF: moebus dense fp32, moebus on the GGUF
blocks (weight_format="gguf"), and llama.cpp through llama-cpp-python, in alternating rounds.

    python loadtest/bench_single_stream.py                     # moebus dense, moebus gguf
    python loadtest/bench_single_stream.py --llama-python /work/peers/llamacpp-venv/bin/python
    python loadtest/bench_single_stream.py --gguf-activations 16,8,float --no-dense
    python loadtest/bench_single_stream.py --module-path         # also each gguf run without the fast path
    python loadtest/bench_single_stream.py --ab-steps 64          # in process: decode steps, fast path on/off
    OMP_NUM_THREADS=1 python loadtest/bench_single_stream.py --block-ns   # the GEMV kernels alone

Each run is a fresh process: one request of --prompt-len random tokens, then --output-len greedy
tokens (EOS ignored); TPOT = (time of the last token - time of the first) / (output-len - 1), in
process (no HTTP on either side). llama.cpp: greedy Llama.create_completion, TPOT from the time of
--output-len tokens minus that of 1 (run_llamacpp says why), n_threads = --threads. moebus runs get OMP_WAIT_POLICY=PASSIVE unless the environment sets it
(on a shared box spinning OpenMP threads stall each other); llama.cpp runs at its library default
unless --llama-wait-policy says otherwise (PASSIVE costs it a futex sleep at every graph barrier). Prints
the CPU flags, a measured read bandwidth and the bytes each system's weights take per token (the
bound: bytes / bandwidth), then per-run TPOTs and the medians with their spread, and the CPU time a
token (process_time over the decode, every thread of the process: robust to a loaded box where
wall time is not). Installs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


def _prompt(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randint(100, 49000) for _ in range(n)]


def run_moebus(fmt: str, prompt_len: int, out_len: int, threads: int) -> dict:
    """fmt: "dense", or "gguf@<bits>" with QuantLinear.activation_bits 16, 8 or float (None); a
    "@module" suffix turns the batch-1 decode fast path (platforms/cpu/decode_fast_path.py) off."""
    import torch

    torch.set_num_threads(threads)
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.quant_linear import QuantLinear
    from moebus.engine.sampling import SamplingParams

    fmt, _, bits = fmt.partition("@")
    bits, _, path = bits.partition("@")
    eng = LLMEngine(EngineConfig(weight_format=fmt, max_num_seqs=1))
    if path == "module":
        eng.model.decode_fast_path = None
    for mod in eng.model.modules():
        if isinstance(mod, QuantLinear) and bits:
            mod.activation_bits = None if bits == "float" else int(bits)
    # Bytes a decode step reads: every weight once (a tied head through lm_head, which pack_linears
    # or the gguf format set), but not the embedding table (a lookup) nor oneDNN's packed copies.
    seen, weight_bytes = set(), 0
    for mod in eng.model.modules():
        for name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if mod is eng.model.embed_tokens or name == "packed" or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            weight_bytes += t.numel() * t.element_size()
    params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
    tpots = []
    for rep in range(2):  # the first warms the kernels up; the second is measured
        eng.add_request(f"r{rep}", _prompt(prompt_len, rep), params)
        stamps = []
        while eng.has_unfinished_requests():
            if any(o.new_token_ids for o in eng.step()):
                stamps.append((time.perf_counter(), time.process_time()))
        tpots.append([(stamps[-1][i] - stamps[0][i]) / (len(stamps) - 1) for i in (0, 1)])
    return {"tpot_ms": 1000 * tpots[-1][0], "cpu_ms": 1000 * tpots[-1][1], "weight_bytes": weight_bytes}


def run_llamacpp(gguf: str, prompt_len: int, out_len: int, threads: int) -> dict:
    """Through Llama.create_completion (greedy: top_k 1, EOS banned): TPOT = (time of out_len tokens -
    time of 1 token) / (out_len - 1), each on a fresh random prompt of the same length (no prefix
    reuse). llama-cpp-python 0.3.36's eval no longer keeps logits without logits_all (the per-token
    loop read them), and on a Sapphire Rapids VM it segfaulted in every multi-token batch: the prompt
    goes a token a ubatch (n_batch = n_ubatch = 1), which decode steps are anyway."""
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=1, n_ubatch=1,
                          verbose=False)
    bias = {llm.token_eos(): -1e9}

    def timed(n: int, seed: int) -> tuple[float, float]:
        llm.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        out = llm.create_completion(_prompt(prompt_len, seed), max_tokens=n, temperature=0.0, top_k=1,
                                    logit_bias=bias)
        assert out["usage"]["completion_tokens"] == n, out["usage"]
        return time.perf_counter() - t0, time.process_time() - c0

    timed(out_len, 99)  # warm-up
    tpot = []
    for rep in range(2):
        full, one = timed(out_len, 2 * rep), timed(1, 2 * rep + 1)
        tpot.append([(full[i] - one[i]) / (out_len - 1) for i in (0, 1)])
    return {"tpot_ms": 1000 * statistics.median(t[0] for t in tpot), "cpu_ms": 1000 * statistics.median(t[1] for t in tpot),
            "weight_bytes": os.path.getsize(gguf), "version": llama_cpp.__version__}


def block_ns(n: int = 576, k: int = 1536, calls: int = 200) -> None:
    """Single-thread ns per weight block of one GEMV call ([rows, k] x [n, k] blocks, ~0.5-0.9 MB of
    weight: cache-resident), the float-activation kernel vs the 8- and 16-bit ones, process_time,
    best of 5 interleaved repeats (load shifts hit every variant alike). Run with OMP_NUM_THREADS=1."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from moebus.kernels.quant_matmul import (
        GGML_TYPES,
        cpu_function,
        qa_cpu_library,
        quant_matmul_cpu_unchecked,
        quant_matmul_qa_cpu_unchecked,
    )

    torch.set_num_threads(1)
    ffn, qfn = cpu_function(), qa_cpu_library().quant_matmul_qa_f32
    for qt in GGML_TYPES:
        w = torch.from_numpy(quantize(torch.randn(n, k).numpy(), GGMLQuantizationType[qt]))
        for rows in (1, 3):
            x, res = torch.randn(rows, k), {}
            tid = GGML_TYPES[qt]
            fs = {"float": lambda x=x, w=w, tid=tid: quant_matmul_cpu_unchecked(ffn, x, w, tid, False),
                  "int8": lambda x=x, w=w, tid=tid: quant_matmul_qa_cpu_unchecked(qfn, x, w, tid, 8),
                  "int16": lambda x=x, w=w, tid=tid: quant_matmul_qa_cpu_unchecked(qfn, x, w, tid, 16)}
            for f in fs.values():
                for _ in range(20):
                    f()
            for _ in range(5):
                for name, f in fs.items():
                    t0 = time.process_time()
                    for _ in range(calls):
                        f()
                    res[name] = min(res.get(name, 1e9), (time.process_time() - t0) / calls / (n * k // 32) * 1e9)
            print(f"{qt} rows={rows}: " + ", ".join(f"{name} {v:.2f}" for name, v in res.items())
                  + f" ns/block (load {os.getloadavg()[0]:.2f})", flush=True)


def ab_steps(steps: int, prompt_len: int, threads: int) -> None:
    """Paired in-process A/B of the batch-1 decode step, fast path on vs off (the module path): one
    gguf@16 request, consecutive decode steps alternating the two (so both see the same context
    lengths and the same load), wall and CPU time of each LLMEngine.step; medians."""
    import torch

    torch.set_num_threads(threads)
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(weight_format="gguf", max_num_seqs=1))
    fast = eng.model.decode_fast_path
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    eng.add_request("ab", _prompt(prompt_len), params)
    times: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for i in range(2 * steps + 8):
        mode = "on" if i % 2 else "off"
        eng.model.decode_fast_path = fast if mode == "on" else None
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        if i >= 8:  # prefill and warm-up steps left out
            times[mode].append((time.perf_counter() - t0, time.process_time() - c0))
    med = {m: [1000 * statistics.median(t[j] for t in ts) for j in (0, 1)] for m, ts in times.items()}
    print(f"decode step, {steps} pairs after a {prompt_len}-token prompt, {threads} threads "
          f"(load {os.getloadavg()[0]:.2f}): fast path {med['on'][0]:.2f} ms (CPU {med['on'][1]:.2f}), "
          f"module path {med['off'][0]:.2f} ms (CPU {med['off'][1]:.2f}): {med['off'][0] / med['on'][0]:.2f}x")


def read_bandwidth_gbs(threads: int) -> float:
    """Best of 5 sums over a 512 MiB float32 tensor (much larger than any cache)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(128 << 20)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def cpu_summary() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return f"{model}, {os.cpu_count()} cpus, flags: {' '.join(f for f in FLAGS if f in flags) or 'none of ' + ','.join(FLAGS)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python (omit: no llama.cpp)")
    ap.add_argument("--llama-wait-policy", default="default", choices=["default", "PASSIVE", "ACTIVE"],
                    help="llama.cpp's OMP_WAIT_POLICY (default: unset, the library's own)")
    ap.add_argument("--gguf-activations", default="16",
                    help="comma list of moebus gguf runs by QuantLinear.activation_bits: 16, 8, float")
    ap.add_argument("--no-dense", action="store_true", help="skip the moebus dense fp32 runs")
    ap.add_argument("--block-ns", action="store_true", help="only the single-thread GEMV kernel timings")
    ap.add_argument("--module-path", action="store_true",
                    help="also run each gguf width with the batch-1 decode fast path off")
    ap.add_argument("--ab-steps", type=int, default=0, help="only the in-process fast path on/off A/B, N pairs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.block_ns:
        block_ns()
        return
    if a.ab_steps:
        ab_steps(a.ab_steps, a.prompt_len, a.threads)
        return
    if a.worker:
        kind, _, arg = a.worker.partition(":")
        res = (run_llamacpp(arg, a.prompt_len, a.output_len, a.threads) if kind == "llamacpp"
               else run_moebus(arg, a.prompt_len, a.output_len, a.threads))
        print("RESULT " + json.dumps(res))
        return
    if a.gguf is None:
        from moebus.text.gguf import embedded_gguf_path

        a.gguf = str(embedded_gguf_path())
    systems = {} if a.no_dense else {"moebus dense fp32": [sys.executable, "moebus:dense"]}
    for bits in a.gguf_activations.split(","):
        systems[f"moebus gguf, {bits} activations"] = [sys.executable, f"moebus:gguf@{bits}"]
        if a.module_path:
            systems[f"moebus gguf, {bits} activations, module path"] = [sys.executable, f"moebus:gguf@{bits}@module"]
    if a.llama_python:
        systems["llama.cpp"] = [a.llama_python, f"llamacpp:{a.gguf}"]
    print(cpu_summary())
    print(f"read bandwidth ({a.threads} threads, 512 MiB sum): {read_bandwidth_gbs(a.threads):.1f} GB/s")
    results: dict[str, list[dict]] = {s: [] for s in systems}
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    # llama.cpp's OpenMP threads meet at a barrier per graph node: it runs at its library default
    # (spin, then sleep) unless asked, since PASSIVE slows it down (docs/benchmarks/history-engine.md)
    llama_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if a.llama_wait_policy != "default":
        llama_env["OMP_WAIT_POLICY"] = a.llama_wait_policy
    for rnd in range(a.rounds):
        for name, (py, worker) in systems.items():
            cmd = [py, __file__, "--worker", worker, "--prompt-len", str(a.prompt_len), "--output-len",
                   str(a.output_len), "--threads", str(a.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=llama_env if name == "llama.cpp" else env,
                                  cwd=Path(__file__).parent.parent, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"round {rnd + 1} {name}: failed\n{proc.stderr[-2000:]}")
                continue
            res = json.loads(line[7:])
            load = os.getloadavg()[0]
            results[name].append(res)
            print(f"round {rnd + 1} {name}: TPOT {res['tpot_ms']:.2f} ms, CPU {res['cpu_ms']:.2f} ms a token "
                  f"(load {load:.2f})", flush=True)
    print(f"\n| system | weight bytes / token | TPOT ms, median (min-max) over {a.rounds} rounds | tok/s "
          "| CPU ms a token (all threads), median |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rs in results.items():
        if not rs:
            continue
        t = [r["tpot_ms"] for r in rs]
        med = statistics.median(t)
        cpu = statistics.median(r["cpu_ms"] for r in rs)
        print(f"| {name} | {rs[0]['weight_bytes'] / 1e6:.0f} MB | {med:.2f} ({min(t):.2f}-{max(t):.2f}) | "
              f"{1000 / med:.1f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
