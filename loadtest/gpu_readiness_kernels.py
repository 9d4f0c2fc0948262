"""The kernel part of gpu_readiness.py: every Triton kernel of moebus.kernels against its torch
reference on one device, with the inputs and tolerances of its tests (tests/kernels/test_<op>.py:
their builders make the hard cases, strided views, ties, NaN rows, and one home keeps the
tolerances from drifting apart), at model-sized shapes (quick: the tests' small ones).

Import this only after TRITON_INTERPRET is settled: the kernels read it when triton is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import pkgutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests" / "kernels"
Outputs = torch.Tensor | tuple[torch.Tensor, ...]
FP32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True, slots=True)
class Case:
    kernel: str  # the Triton entry point checked, e.g. "rms_norm_triton"
    label: str  # shape, dtype, options
    run: Callable[[], tuple[Outputs, Outputs]]  # (the Triton kernel's outputs, the torch reference's)
    atol: float = 0.0  # 0 and 0: exact (indices)
    rtol: float = 0.0


def kernel_tests(name: str) -> ModuleType:
    """tests/kernels/<name>.py, loaded by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_readiness_{name}", TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as an import would
    spec.loader.exec_module(module)
    return module


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no nan / inf


def _worst(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def compare(actual: Outputs, expected: Outputs, atol: float, rtol: float) -> dict[str, Any]:
    """assert_close's rule |a - e| <= atol + rtol |e| (NaN equals NaN), reported instead of raised:
    max abs error, max rel error over |e| > atol (the values that matter: near-zero ones make any
    relative error huge), the worst fraction of the tolerance used, and the elements outside it."""
    pairs_a, pairs_e = (x if isinstance(x, tuple) else (x,) for x in (actual, expected))
    if len(pairs_a) != len(pairs_e):
        return {"ok": False, "error": f"{len(pairs_a)} outputs, the reference has {len(pairs_e)}"}
    max_abs = max_rel = used = 0.0
    bad = elements = 0
    for a, e in zip(pairs_a, pairs_e, strict=True):
        if a.shape != e.shape or a.dtype != e.dtype:
            return {"ok": False, "error": f"{a.dtype}{list(a.shape)}, the reference gives {e.dtype}{list(e.shape)}"}
        a, e = a.detach().cpu().double(), e.detach().cpu().double()
        diff = torch.where((a == e) | (a.isnan() & e.isnan()), 0.0, (a - e).abs())  # inf == inf too
        allowed = atol + rtol * e.abs()
        bad += int(((diff != 0) & ~(diff <= allowed)).sum())  # a NaN difference is outside
        elements += a.numel()
        if not a.numel():
            continue
        max_abs = _worst(max_abs, float(diff.max()))
        big = e.abs() > atol
        if big.any():
            max_rel = _worst(max_rel, float((diff[big] / e.abs()[big]).max()))
        if atol or rtol:
            used = _worst(used, float(torch.where(diff == 0, 0.0, diff / allowed).max()))
    return {"ok": bad == 0, "max_abs": _finite(max_abs), "max_rel": _finite(max_rel),
            "tol_used": _finite(used) if atol or rtol else None, "mismatches": bad, "elements": elements}


def run_case(case: Case) -> dict[str, Any]:
    """One case's row; an exception (a launch, a shape assert) is a failed row, not a crash."""
    row: dict[str, Any] = {"kernel": case.kernel, "case": case.label, "atol": case.atol, "rtol": case.rtol}
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        row |= compare(*case.run(), case.atol, case.rtol)
    except Exception as e:  # noqa: BLE001 - reported in the row, the other kernels still run
        row |= {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def triton_entry_points() -> list[str]:
    """Every public `<op>_triton` defined in a moebus.kernels module: what a run must cover."""
    import moebus.kernels as pkg

    names = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        names += [n for n, f in vars(mod).items() if n.endswith("_triton") and not n.startswith("_")
                  and inspect.isfunction(f) and f.__module__ == mod.__name__]
    return sorted(names)


def _dt(dtype: torch.dtype) -> str:
    return {FP32: "fp32", BF16: "bf16"}.get(dtype, str(dtype))


# Each builder: (device, quick) -> its cases. Full shapes are model-sized: SmolLM2-135M (hidden 576,
# 9 q / 3 kv heads of 64, MLP 1536, vocab 49152) and DeepSeek-V2-Lite / V4-like MoE and mHC layers.

def _norms(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.rmsnorm import (
        fused_add_rms_norm_ref,
        fused_add_rms_norm_triton,
        rms_norm_ref,
        rms_norm_triton,
    )

    t = kernel_tests("test_rmsnorm")
    shapes = [((17, 81), FP32), ((2, 5, 64), BF16)] if quick else [((64, 576), FP32), ((256, 4096), BF16),
                                                                    ((256, 7168), BF16)]
    out = []
    for shape, dt in shapes:
        def one(shape=shape, dt=dt) -> tuple[Outputs, Outputs]:
            x, _, w = t._inputs(shape, dt, dev)
            return rms_norm_triton(x, w, t.EPS), rms_norm_ref(x, w, t.EPS)

        def fused(shape=shape, dt=dt) -> tuple[Outputs, Outputs]:
            x, r, w = t._inputs(shape, dt, dev)
            return fused_add_rms_norm_triton(x, r, w, t.EPS), fused_add_rms_norm_ref(x, r, w, t.EPS)

        out += [Case("rms_norm_triton", f"{shape} {_dt(dt)}", one, *t.TOL[dt]),
                Case("fused_add_rms_norm_triton", f"{shape} {_dt(dt)}", fused, *t.TOL[dt])]
    return out


def _rotary(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.rotary import apply_rotary_ref, apply_rotary_triton

    t = kernel_tests("test_rotary")
    # (T, Hq, Hk, D, rotary dim): q and k as views of one fused qkv projection, as models give them
    cases = [((17, 8, 2, 64, 32), FP32), ((33, 4, 1, 81, 80), BF16)] if quick else [
        ((256, 9, 3, 64, 64), FP32), ((512, 32, 8, 128, 64), BF16)]
    out = []
    for c, dt in cases:
        def run(c=c, dt=dt) -> tuple[Outputs, Outputs]:
            q, kk, cos, sin, _ = t._inputs(c, dt, dev, views=True)
            return apply_rotary_triton(q, kk, cos, sin), apply_rotary_ref(q, kk, cos, sin)
        out.append(Case("apply_rotary_triton", f"T,Hq,Hk,D,R={c} {_dt(dt)} views", run, *t.TOL[dt]))
    return out


def _silu(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.silu_mul import silu_and_mul_ref, silu_and_mul_triton

    t = kernel_tests("test_silu_mul")
    cases = [((17, 162), FP32, None), ((33, 290), BF16, 7.0)] if quick else [
        ((64, 3072), FP32, None), ((256, 2816), BF16, None), ((256, 4096), BF16, 7.0)]
    out = []
    for shape, dt, limit in cases:
        def run(shape=shape, dt=dt, limit=limit) -> tuple[Outputs, Outputs]:
            x = torch.randn(shape, dtype=dt, device=dev) * 5  # as the test: wide enough that the limit clamps
            return silu_and_mul_triton(x, limit=limit), silu_and_mul_ref(x, limit=limit)
        out.append(Case("silu_and_mul_triton", f"{shape} {_dt(dt)} limit={limit}", run, *t.TOL[dt]))
    return out


def _argmaxes(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.argmax import row_argmax_ref, row_argmax_triton
    from moebus.kernels.lm_head_argmax import lm_head_argmax_ref, lm_head_argmax_triton

    ta, th = kernel_tests("test_argmax"), kernel_tests("test_lm_head_argmax")
    rows = [((5, 513), FP32), ((64, 4113), BF16)] if quick else [((64, 49152), FP32), ((256, 129280), BF16)]
    heads = [((5, 13, 37), FP32), ((13, 64, 300), BF16)] if quick else [((64, 576, 49152), FP32),
                                                                       ((16, 1024, 32000), BF16)]
    out = []
    for shape, dt in rows:  # ties, NaN, all -inf and inf rows among random ones
        def rows_run(shape=shape, dt=dt) -> tuple[Outputs, Outputs]:
            x = ta._cases(shape, dt, dev)
            return row_argmax_triton(x), row_argmax_ref(x)
        out.append(Case("row_argmax_triton", f"{shape} {_dt(dt)} hard rows", rows_run))
    for (m, kk, n), dt in heads:  # integer-valued: exact in float32 whatever the summation order
        def head_run(m=m, kk=kk, n=n, dt=dt) -> tuple[Outputs, Outputs]:
            x, w = (v.contiguous().to(dev) for v in th._cases(m, kk, n, dt))
            return lm_head_argmax_triton(x, w), lm_head_argmax_ref(x, w)
        out.append(Case("lm_head_argmax_triton", f"M,K,N=({m}, {kk}, {n}) {_dt(dt)} integer-valued", head_run))
    return out


def _quant_matmul(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.quant_matmul import quant_matmul_ref, quant_matmul_triton

    t = kernel_tests("test_quant_matmul")
    cases = [((1, 32, 7), "Q4_0"), ((17, 96, 33), "Q8_0")] if quick else [
        ((1, 576, 1536), "Q4_0"), ((32, 2048, 2048), "Q4_1"), ((64, 1536, 576), "Q8_0")]
    out = []
    for (m, kk, n), qtype in cases:
        def run(m=m, kk=kk, n=n, qtype=qtype) -> tuple[Outputs, Outputs]:
            x, w, _ = t._case(m, kk, n, qtype)
            x, w = x.contiguous().to(dev), w.to(dev)
            return quant_matmul_triton(x, w, qtype), quant_matmul_ref(x, w, qtype)
        out.append(Case("quant_matmul_triton", f"M,K,N=({m}, {kk}, {n}) {qtype}", run, t.TOL["atol"], t.TOL["rtol"]))
    return out


def _paged_attention(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton

    t = kernel_tests("test_paged_attention")
    # (dtype, group, head dims, sequence lengths, window, sinks): the test cache has 2 kv heads
    cases = [(FP32, 4, 64, [1, 17, 33, 48], None, False), (BF16, 1, 81, [1, 17, 33, 48], 7, True)] if quick else [
        (FP32, 3, 64, [1, 17, 1000, 4096], None, False), (BF16, 8, 128, [1, 17, 1000, 4096], None, False),
        (BF16, 4, 64, [4096, 130, 1, 777], 128, True)]
    out = []
    for dt, group, d, lens, window, sinks in cases:
        def run(dt=dt, group=group, d=d, lens=lens, window=window, sinks=sinks) -> tuple[Outputs, Outputs]:
            q, kc, vc, bt, sl, scale, s = t.make_inputs(dt, dev, group, d, d, seq_lens=lens)
            s = s if sinks else None
            return (paged_attention_decode_triton(q, kc, vc, bt, sl, scale, window, s),
                    paged_attention_decode_ref(q, kc, vc, bt, sl, scale, window, s))
        label = f"Hq/Hkv={2 * group}/2 D={d} lens={lens} window={window} sinks={sinks} {_dt(dt)}"
        out.append(Case("paged_attention_decode_triton", label, run, *t.TOL[dt]))
    return out


def _fused_moe(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.fused_moe import fused_moe_ref, fused_moe_triton

    t = kernel_tests("test_fused_moe")
    # (T, D, I, E, top-k); full: DeepSeek-V2-Lite's experts (D 2048, I 1408, 64 experts, top-6)
    cases = [((17, 81, 48, 8, 2), FP32, None), ((33, 64, 81, 6, 4), BF16, 0.5)] if quick else [
        ((64, 1024, 512, 16, 2), FP32, None), ((8, 2048, 1408, 64, 6), BF16, None),
        ((256, 2048, 1408, 64, 6), BF16, 7.0)]
    out = []
    for c, dt, limit in cases:
        def run(c=c, dt=dt, limit=limit) -> tuple[Outputs, Outputs]:
            args = t.make_inputs(c, dt, dev)
            return fused_moe_triton(*args, swiglu_limit=limit), fused_moe_ref(*args, swiglu_limit=limit)
        out.append(Case("fused_moe_triton", f"T,D,I,E,k={c} {_dt(dt)} limit={limit}", run, *t.TOL[dt]))
    return out


def _mhc(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.mhc import hc_merge_ref, hc_merge_triton, hc_mix_ref, hc_mix_triton

    t = kernel_tests("test_mhc")
    mixes = [(17, 4, 20)] if quick else [(1, 4, 20), (512, 4, 20)]  # (T, streams, Sinkhorn iterations)
    merges = [((17, 4, 81), BF16)] if quick else [((64, 4, 4096), FP32), ((512, 4, 4096), BF16)]
    out = []
    for tt, n, iters in mixes:
        def mix(tt=tt, n=n, iters=iters) -> tuple[Outputs, Outputs]:
            m, base, scale = t._inputs(tt, n, dev)
            return hc_mix_triton(m, base, scale, n, iters, t.EPS), hc_mix_ref(m, base, scale, n, iters, t.EPS)
        out.append(Case("hc_mix_triton", f"T={tt} n={n} iters={iters} fp32", mix, *t.TOL))
    for (tt, n, hh), dt in merges:
        def merge(tt=tt, n=n, hh=hh, dt=dt) -> tuple[Outputs, Outputs]:
            args = t._merge_inputs(tt, n, hh, dt, dev)
            return hc_merge_triton(*args), hc_merge_ref(*args)
        out.append(Case("hc_merge_triton", f"T,n,H=({tt}, {n}, {hh}) {_dt(dt)}", merge, *t.MERGE_TOL[dt]))
    return out


def _compressor(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.compressor import compress_windows_ref, compress_windows_triton

    t = kernel_tests("test_compressor")
    # (windows, slots, channels): CSA-like 8 slots, HCA-like 128
    cases = [((5, 8, 81), FP32), ((3, 128, 33), BF16)] if quick else [((512, 8, 512), FP32), ((64, 128, 512), BF16)]
    out = []
    for shape, dt in cases:
        def run(shape=shape, dt=dt) -> tuple[Outputs, Outputs]:
            kv, gate, bias = t.inputs(shape, dt, dev)
            return compress_windows_triton(kv, gate, bias), compress_windows_ref(kv, gate, bias)
        out.append(Case("compress_windows_triton", f"{shape} {_dt(dt)}", run, *t.TOL[dt]))
    return out


def _indexer(dev: str, quick: bool) -> list[Case]:
    from moebus.kernels.indexer_topk import _masked_scores_ref, indexer_topk_ref, indexer_topk_triton

    t = kernel_tests("test_indexer_topk")
    # (rows, heads, dim, sequences, k); the test's builder gives each sequence < 40 keys. Compared: the
    # reference's scores of the entries each picks (-inf for a -1), so that two entries whose float32
    # scores differ in the last bit may swap, as a GPU's summation order may make them.
    cases = [(9, 8, 16, 3, 4)] if quick else [(64, 64, 128, 4, 16), (512, 64, 128, 16, 32)]
    out = []
    for rows, heads, dim, seqs, topk in cases:
        def run(rows=rows, heads=heads, dim=dim, seqs=seqs, topk=topk) -> tuple[Outputs, Outputs]:
            args = t.inputs(rows, heads, dim, seqs, FP32, dev)
            scores = _masked_scores_ref(*args, dim ** -0.5)
            picked = [torch.where(i >= 0, scores.gather(1, i.clamp(min=0)), float("-inf")) if scores.numel()
                      else i.float() for i in (indexer_topk_triton(*args, topk, dim ** -0.5),
                                               indexer_topk_ref(*args, topk, dim ** -0.5))]
            return picked[0], picked[1]
        out.append(Case("indexer_topk_triton", f"rows={rows} heads={heads} dim={dim} k={topk} fp32, picked scores",
                        run, 1e-5, 1e-5))
    return out


BUILDERS = (_norms, _rotary, _silu, _argmaxes, _quant_matmul, _paged_attention, _fused_moe, _mhc, _compressor,
            _indexer)


def check_kernels(device: str, quick: bool, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every case's row, and the Triton entry points no case covered (a failure: a new kernel
    needs a case here)."""
    rows = []
    for build in BUILDERS:
        try:
            built = build(device, quick)
        except Exception as e:  # noqa: BLE001 - e.g. a test module that no longer imports
            rows.append({"kernel": build.__name__.strip("_"), "case": "(building the cases)", "ok": False,
                         "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        for case in built:
            rows.append(row := run_case(case))
            log(f"  {row['kernel']:30s} {row['case']:60s} {'ok' if row['ok'] else 'FAIL'} ({row['seconds']:.1f} s)")
    covered = {r["kernel"] for r in rows}
    return rows, [name for name in triton_entry_points() if name not in covered]
