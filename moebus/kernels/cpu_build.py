"""Compile and load the C kernels in kernels/csrc: the optimized CPU path beside each torch reference.

Each source is built once per (source, compiler, CPU flags) into the user cache with the system C
compiler (-O3 -march=native -fopenmp) and loaded with ctypes. The library links libgomp by soname,
so inside a torch process it shares torch's own OpenMP runtime and thread pool instead of starting
a second one. No compiler, or a failed build, returns None and callers keep the torch reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

_CSRC = Path(__file__).with_name("csrc")
# -fno-trapping-math: without it GCC will not if-convert the float selects in fast_exp, so the SiLU
# and softmax loops stayed scalar on AVX2 (docs/benchmarks/history-engine.md, "-fno-trapping-math").
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-std=gnu11"]


def _cpu_signature() -> str:
    """-march=native depends on the CPU: key builds by its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()}:{flags}"


def _cache_root() -> Path:
    base = os.environ.get("MOEBUS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "moebus")
    return Path(base).expanduser() / "kernels"


def build(source: str, cc: str | None = None) -> Path | None:
    """Path to the shared library built from csrc/<source>, or None when it cannot be built."""
    cc = cc or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if os.environ.get("MOEBUS_DISABLE_CPU_KERNELS") or not cc:
        return None
    src = _CSRC / source
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    headers = [h.read_text() for h in sorted(_CSRC.glob("*.h"))]
    key = hashlib.sha256("\0".join([src.read_text(), *headers, cc, version, *_FLAGS, _cpu_signature()]).encode())
    out = _cache_root() / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        proc = subprocess.run([cc, *_FLAGS, "-o", str(tmp_lib), str(src), "-lm"], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            return None
        os.replace(tmp_lib, out)  # atomic: concurrent builders (test workers, ranks) never see half a file
    return out


# Extra flags for build_variant that take away what a smaller CPU lacks.
NO_AVX512 = ["-mno-avx512f"]
SCALAR = [*NO_AVX512, "-mno-avx2", "-mno-fma"]


def build_variant(source: str, extra_flags: list[str], out_dir: Path) -> ctypes.CDLL | None:
    """csrc/<source> built into out_dir with extra_flags after the usual ones and loaded, uncached;
    None without a C compiler; a failed build raises. For tests: e.g. -mno-avx512f builds the paths
    a smaller CPU takes, so that they are checked on a bigger one."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None
    out = out_dir / Path(source).with_suffix(".so").name
    subprocess.run([cc, *_FLAGS, *extra_flags, "-o", str(out), str(_CSRC / source), "-lm"], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(out))


@dataclass
class CpuLibrary:
    """A lazily built C library; `get()` returns the loaded CDLL or None (then use the reference)."""

    source: str
    _lib: ctypes.CDLL | None = field(default=None, init=False)
    _tried: bool = field(default=False, init=False)

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            self._tried = True
            path = build(self.source)
            self._lib = ctypes.CDLL(str(path)) if path is not None else None
        return self._lib

    def function(self, name: str, dtype: torch.dtype, argtypes: list) -> Callable[..., int] | None:
        """The entry point `<name>_<f32|bf16|f16>` for tensors of `dtype`, or None."""
        return self.entry(f"{name}_{DTYPE_SUFFIX[dtype]}", argtypes) if dtype in DTYPE_SUFFIX else None

    def entry(self, symbol: str, argtypes: list) -> Callable[..., int] | None:
        """The entry point named `symbol` (returning int), or None without the library."""
        lib = self.get()
        if lib is None:
            return None
        fn = getattr(lib, symbol)
        if fn.argtypes is None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn


DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


@functools.cache
def library(source: str) -> CpuLibrary:
    """One handle per source file in this process (every op of a file shares its build)."""
    return CpuLibrary(source)


def on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels may take these tensors: CPU, one supported dtype, last dim contiguous."""
    t0 = tensors[0]
    return all(t.device.type == "cpu" and t.dtype == t0.dtype and (t.dim() == 0 or t.stride(-1) == 1)
               for t in tensors) and t0.dtype in DTYPE_SUFFIX
