"""The platform seam (moebus/platforms): one Platform a device, each satisfying the protocol, and
the torch-free modules staying torch-free (services read core counts and flags from them)."""
from __future__ import annotations

import subprocess
import sys
import typing

import torch

from moebus import platforms
from moebus.platforms.interface import Platform

TORCH_FREE = ("moebus.platforms", "moebus.platforms.cpu.cores", "moebus.platforms.cpu.core_share",
              "moebus.platforms.cpu.flags", "moebus.platforms.dtype_choice", "moebus.services.cli",
              "moebus.services.worker.service")


def test_one_platform_per_device() -> None:
    cpu = platforms.current("cpu")
    assert cpu is platforms.current(torch.device("cpu")) and type(cpu).__name__ == "CpuPlatform"
    gpu = platforms.current("cuda:0")
    assert type(gpu).__name__ == "CudaPlatform" and gpu.device == "cuda:0"
    assert cpu.raw_argmax and not gpu.raw_argmax


def test_every_platform_has_the_protocol_s_members() -> None:
    members = {n for n in dir(Platform) if not n.startswith("_")} | set(typing.get_type_hints(Platform))
    for p in (platforms.current("cpu"), platforms.current("cuda")):
        assert all(hasattr(p, n) for n in members), (p, members - set(dir(p)))


def test_off_the_cpu_no_cpu_fast_path() -> None:
    gpu = platforms.current("cuda")
    assert gpu.decode_fast_path(torch.nn.Linear(2, 2)) is None
    assert not gpu.panels_wanted(torch.float32) and not gpu.tune_malloc()


def test_the_seam_and_host_modules_import_no_torch() -> None:
    code = f"import sys; import {', '.join(TORCH_FREE)}; assert 'torch' not in sys.modules, 'torch'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
