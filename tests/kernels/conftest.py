"""Kernel tests. Without a GPU the Triton kernels run on CPU tensors through triton's interpreter.

triton picks compiled vs interpreted when each `@triton.jit` runs (its own tl.sum & co. included),
i.e. when triton and the kernel modules are imported, so TRITON_INTERPRET=1 must be set before
anything imports triton. Run alone, tests/kernels sets it here. In a whole-suite run another test
directory has usually imported moebus.kernels (hence triton) first; then the Triton tests are
delegated to one child pytest with TRITON_INTERPRET=1 and their outcomes reported here.
Set MOEBUS_KERNEL_ERRLOG=path to append each comparison's max abs error and max |expected| there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

_GPU = torch.cuda.is_available()
_HERE = Path(__file__).parent
_RESULTS_ENV = "MOEBUS_KERNEL_TRITON_RESULTS"  # set in the child: where it writes outcomes
_DELEGATE = not _GPU and "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET")
if not _GPU and not _DELEGATE:
    os.environ["TRITON_INTERPRET"] = "1"

_delegated: list[str] = []
_child_results: dict[str, tuple[str, str]] | None = None


def _uses_triton(item: pytest.Item) -> bool:
    return "triton_device" in getattr(item, "fixturenames", ()) and item.path.is_relative_to(_HERE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _DELEGATE:
        _delegated[:] = [item.nodeid for item in items if _uses_triton(item)]


def _run_child(rootpath: Path) -> dict[str, tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", _RESULTS_ENV: str(out)}
        # -m "": the parent already chose these tests (its tier); the child must not deselect them
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *_delegated],
                              cwd=rootpath, env=env, capture_output=True, text=True, timeout=900)
        results = {}
        if out.exists():
            for line in out.read_text().splitlines():
                r = json.loads(line)
                results.setdefault(r["nodeid"], (r["outcome"], r["text"]))
        results["<child output>"] = ("", (proc.stdout + proc.stderr)[-4000:])
        return results


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    global _child_results
    if not (_DELEGATE and _uses_triton(pyfuncitem)):
        return None
    if _child_results is None:
        _child_results = _run_child(pyfuncitem.config.rootpath)
    outcome, text = _child_results.get(pyfuncitem.nodeid, ("missing", _child_results["<child output>"][1]))
    if outcome == "skipped":
        pytest.skip(text)
    if outcome != "passed":
        pytest.fail(f"[TRITON_INTERPRET=1 child pytest] {outcome}:\n{text}", pytrace=False)
    return True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(_RESULTS_ENV)
    if path and (report.when == "call" or not report.passed):  # first non-pass wins in the parent
        text = report.longreprtext if not report.skipped else str(report.longrepr[-1])
        with open(path, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome, "text": text}) + "\n")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def triton_device() -> str:
    """Device for `<op>_triton` calls: CUDA when present, else CPU under the interpreter."""
    pytest.importorskip("triton")
    if _GPU or _DELEGATE:
        return "cuda" if _GPU else "cpu"
    from triton.runtime.interpreter import InterpretedFunction

    from moebus.kernels import rmsnorm

    assert isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction), "Triton kernels compiled, not interpreted"
    return "cpu"


@pytest.fixture
def close(request: pytest.FixtureRequest) -> Callable[..., None]:
    """assert_close on float64 CPU copies, logging the max abs error if asked to."""

    def check(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
        a = actual.detach().cpu().double()
        e = expected.detach().cpu().double()
        log = os.environ.get("MOEBUS_KERNEL_ERRLOG")
        if log:
            err = (a - e).abs().max().item() if a.numel() and a.shape == e.shape else float("nan")
            scale = e.abs().max().item() if e.numel() else 0.0
            with open(log, "a") as f:
                f.write(f"{request.node.nodeid}\t{err:.3e}\t{scale:.3e}\n")
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)

    return check


@pytest.fixture(scope="session")
def rebuilt(tmp_path_factory) -> Callable[[str, list[str], str], object]:
    """rebuilt(source, flags, name): csrc/<source> built again with extra flags (cpu_build.NO_AVX512,
    SCALAR, ...) so the paths a smaller CPU takes are checked on this one; skips without a C compiler."""
    from moebus.kernels import cpu_build  # here, not at the top: TRITON_INTERPRET must be set first

    def build(source: str, flags: list[str], name: str):
        lib = cpu_build.build_variant(source, flags, tmp_path_factory.mktemp(name))
        if lib is None:
            pytest.skip("no C compiler")
        return lib
    return build
