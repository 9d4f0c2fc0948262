"""loadtest/gpu_readiness.py without a GPU: the whole script as CI runs it (--device cpu --quick: the
Triton kernels under TRITON_INTERPRET=1, the engine on CPU), its JSON, and that its checks can fail."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"
pytest.importorskip("triton")
pytest.importorskip("transformers")


def _script_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"readiness_{name}", LOADTEST / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOADTEST / "gpu_readiness.py"), "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("readiness")
    proc = _run(out, "--device", "cpu", "--quick", "--threads", "1")  # 1 thread: faster on 2 shared cores
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (out / "summary.txt").read_text().startswith("gpu_readiness: READY on cpu (CPU, Triton interpreted)")
    return json.loads((out / "gpu_readiness.json").read_text())


def test_every_triton_kernel_checked_and_passed(report) -> None:
    # from the source, not the script's own discovery: a new `<op>_triton` must get a case
    defined = {name for path in (ROOT / "moebus" / "kernels").glob("[!_]*.py")
               for name in re.findall(r"^def ([a-z]\w*_triton)\(", path.read_text(), re.M)}
    assert {r["kernel"] for r in report["kernels"]} == defined and report["uncovered"] == []
    assert report["env"]["triton_interpreted"] is True
    for r in report["kernels"]:
        assert r["ok"] and r["mismatches"] == 0 and r["elements"] > 0, r
        assert isinstance(r["max_abs"], float) and isinstance(r["max_rel"], float), r


def test_parity_rows_present_and_passed(report) -> None:
    rows = {r["model"]: r for r in report["parity"]}
    assert set(rows) == {"smollm2", "tiny-v4"}
    for r in rows.values():
        assert r["ok"] and all(r["checks"].values()), r
        assert r["scored_tokens"] > 0 and r["prompts"] > 0 and r["greedy_matched"] + r["ties"] >= r["prompts"]


def test_throughput_rows_present_and_positive(report) -> None:
    rows = report["throughput"]
    assert [r["batch"] for r in rows] == [1, 16, 64]
    for r in rows:
        assert r["ok"] and r["decode_tok_s"] > 0 and r["decode_tokens"] > 0 and "in-process" in r["kind"], r
    assert report["failures"] == [] and report["ok"] is True


def test_a_broken_kernel_is_reported() -> None:
    kernels, script = _script_module("gpu_readiness_kernels"), _script_module("gpu_readiness")
    x = torch.randn(64, 33)
    assert kernels.compare(x, x.clone(), 1e-5, 1e-5)["ok"]
    off = x.clone()
    off[3, 7] += 1e-3  # one element past atol + rtol |x|
    bad = kernels.compare(off, x, 1e-5, 1e-5)
    assert not bad["ok"] and bad["mismatches"] == 1 and bad["tol_used"] > 1 and bad["max_abs"] == pytest.approx(1e-3, rel=1e-2)
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert not kernels.compare((x, nan), (x, x), 1e-2, 1e-2)["ok"]  # a NaN in the second output
    assert kernels.compare((nan,), (nan,), 0, 0)["ok"]  # NaN where the reference has NaN is equal
    ids = torch.arange(10)
    assert not kernels.compare(ids.flip(0), ids, 0, 0)["ok"]  # indices: exact
    assert "reference gives" in kernels.compare(x.bfloat16(), x, 1, 1)["error"]
    # a kernel whose output is off: its row fails, and the run's verdict names it
    row = kernels.run_case(kernels.Case("rms_norm_triton", "perturbed", lambda: (off, x), 1e-5, 1e-5))
    crash = kernels.run_case(kernels.Case("silu_and_mul_triton", "raises", lambda: 1 / 0))
    assert not row["ok"] and not crash["ok"] and crash["error"].startswith("ZeroDivisionError")
    report = {"kernels": [row, crash], "uncovered": ["new_op_triton"], "parity": [], "throughput": []}
    lines = script.failures(report)
    assert len(lines) == 3 and "rms_norm_triton [perturbed]: 1 elements" in lines[0] and "new_op_triton" in lines[2]
    # failed parity and throughput rows too, and the summary of a failed run prints them all
    report |= {"parity": [{"model": "smollm2", "ok": False, "error": "OSError: no GGUF"}],
               "throughput": [{"ok": False, "error": "RuntimeError: CUDA out of memory"}]}
    report |= {"failures": script.failures(report), "ok": False, "quick": True, "seconds": 1.0,
               "env": {"device": "cuda", "gpu": "a GPU", "torch": "t", "triton": "t", "transformers": "t"}}
    text = script.summary(report)
    assert text.startswith("gpu_readiness: NOT READY on cuda (a GPU)") and len(report["failures"]) == 5
    assert all(line in text for line in report["failures"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_device_without_cuda_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_readiness: --device cuda, but torch"), proc.stderr
    assert not (tmp_path / "gpu_readiness.json").exists()
