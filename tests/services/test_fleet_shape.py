"""`moebus up --workers auto`: two workers sharing the cores where the host has the cores and the
memory for them, else one; the CLI passes what it chose to the launcher."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from moebus.cli import main
from moebus.services import cli as services_cli
from moebus.services import fleet_shape
from moebus.services.fleet_shape import SHARED_BURST_STEP_TOKENS, auto_shape, mem_available, model_file_bytes
from moebus.shared.logs import LOG_FORMAT_ENV

GIB = 1 << 30
SMOLLM2_GGUF = 98_362_432


def test_auto_shares_the_cores_where_cores_and_memory_allow():
    shape = auto_shape(2, SMOLLM2_GGUF, GIB, 20 * GIB)
    assert (shape.workers, shape.share_cores) == (2, True) and "2 cores" in shape.why
    assert auto_shape(16, SMOLLM2_GGUF, GIB, 20 * GIB).workers == 2


@pytest.mark.parametrize("cores, model, mem, why", [
    (1, SMOLLM2_GGUF, 20 * GIB, "1 core"),
    (2, SMOLLM2_GGUF, 8 * GIB, "GiB available"),  # ~4.2 GiB a worker estimated: two do not fit in 8
    (2, 4 * GIB, 64 * GIB, "GiB available"),  # a model of 4 GB on disk: ~100 GB a worker
    (2, None, 20 * GIB, "unknown"),
    (2, SMOLLM2_GGUF, None, "unknown"),
])
def test_auto_keeps_one_worker_otherwise(cores, model, mem, why):
    shape = auto_shape(cores, model, GIB, mem)
    assert (shape.workers, shape.share_cores) == (1, False) and why in shape.why


def test_the_sizes_it_reads(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "part.gguf").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")  # not weights
    assert model_file_bytes(tmp_path) == 1024
    assert model_file_bytes(tmp_path / "sub" / "part.gguf") == 24
    assert model_file_bytes(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert model_file_bytes(tmp_path / "empty") is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   2000000 kB\n")
    assert mem_available(meminfo) == 2_000_000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert mem_available(meminfo) is None
    assert mem_available(tmp_path / "nothing") is None


def _up(monkeypatch, argv: list[str], cores: int = 2, mem: int | None = 20 * GIB) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake_up(**kw: Any) -> int:
        seen.update(kw, share_dir_existed=os.path.isdir(kw["worker"].get("core_share_dir", "")))
        return 0

    monkeypatch.setattr(services_cli, "up", fake_up)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)))
    monkeypatch.setattr(services_cli, "mem_available", lambda: mem)
    monkeypatch.setenv(LOG_FORMAT_ENV, "text")
    assert main(["up", *argv]) == 0
    return seen


def test_up_starts_two_sharing_workers_by_default(monkeypatch, capsys):
    kw = _up(monkeypatch, [])
    assert kw["workers"] == 2
    assert kw["worker"]["torch_threads"] == 2 and kw["share_dir_existed"]
    assert not os.path.exists(kw["worker"]["core_share_dir"])  # removed when the stack stopped
    assert kw["engine"]["burst_step_tokens"] == SHARED_BURST_STEP_TOKENS
    assert "workers: 2 sharing the cores (--workers auto: 2 cores" in capsys.readouterr().err


def test_up_keeps_one_worker_where_auto_says_so_or_the_operator_does(monkeypatch, capsys):
    kw = _up(monkeypatch, [], cores=1)
    assert kw["workers"] == 1 and "core_share_dir" not in kw["worker"] and "burst_step_tokens" not in kw["engine"]
    assert "workers: 1 (--workers auto: 1 core)" in capsys.readouterr().err
    kw = _up(monkeypatch, [], mem=4 * GIB)
    assert kw["workers"] == 1 and "core_share_dir" not in kw["worker"]
    assert "workers: 1 (--workers auto: 4.0 GiB available, two workers want" in capsys.readouterr().err
    kw = _up(monkeypatch, ["--workers", "1"])
    assert kw["workers"] == 1 and kw["worker"] == {} and "burst_step_tokens" not in kw["engine"]
    kw = _up(monkeypatch, ["--torch-threads", "1"])  # threads chosen: the operator shapes the fleet
    assert kw["workers"] == 1 and kw["worker"] == {"torch_threads": 1}
    kw = _up(monkeypatch, ["--model", "toy"])
    assert kw["workers"] == 1 and kw["worker"] == {}
    assert capsys.readouterr().err == ""  # auto said nothing where it did not choose


def test_an_engine_burst_budget_given_is_kept(monkeypatch):
    kw = _up(monkeypatch, ["--engine", '{"burst_step_tokens": 768}'])
    assert kw["workers"] == 2 and kw["engine"]["burst_step_tokens"] == 768


def test_workers_takes_auto_or_a_count(monkeypatch, capsys):
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            main(["up", "--workers", bad])
        assert "--workers" in capsys.readouterr().err


def test_the_file_estimate_covers_the_measured_worker():
    """SmolLM2's float32 worker measured 3.3 GB resident (its 1 GiB KV cache included)."""
    est = SMOLLM2_GGUF * fleet_shape.BYTES_PER_FILE_BYTE + GIB + fleet_shape.RUNTIME_BYTES
    assert est >= 3.3e9
