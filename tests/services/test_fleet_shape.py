"""`moebus up --workers auto`: two workers sharing the cores where the host has the cores and the
memory for them, else one; a worker's memory estimated from the weight elements its model's header
declares (services/worker_memory.py); the CLI passes what it chose to the launcher."""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from moebus.cli import main
from moebus.engine.models import resolve
from moebus.services import cli as services_cli
from moebus.services.fleet_shape import SHARED_BURST_STEP_TOKENS, auto_shape, mem_available
from moebus.services.worker_memory import (
    FALLBACK_PER_FILE_BYTE,
    RUNTIME_BYTES,
    Estimate,
    estimate,
    model_file_bytes,
    read_header,
)
from moebus.shared.logs import LOG_FORMAT_ENV

GIB = 1 << 30
ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}  # bf16 dense, Llama GGUFs on blocks
AVX2 = {"avx2", "fma"}  # float32 dense
HOST_24G = 22 * GIB  # MemAvailable of a 24 GiB host with nothing else running
# Granite-3.0-1B-A400M's shapes (loadtest/moe_checkpoint.py): vocabulary, hidden, layers, experts, expert width, KV width
VOCAB, HIDDEN, LAYERS, EXPERTS, INTER, KV = 49152, 1024, 24, 32, 512, 512
GRANITE_ELEMENTS, GRANITE_EXPERT_ELEMENTS = 1_334_625_280, 1_207_959_552  # its Q8_0 GGUF's header


def _granite_gguf(path: Path) -> Path:
    """A GGUF holding only the header of the Granite-shaped Q8_0 file: its tensors declared, no data."""
    w = GGUFWriter(path, "granitemoe")
    w.add_uint32("granitemoe.expert_count", EXPERTS)
    q8, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32

    def declare(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType = q8) -> None:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 0, raw_dtype=kind)

    declare("token_embd.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        for part, shape in (("ffn_gate_exps", (EXPERTS, INTER, HIDDEN)), ("ffn_up_exps", (EXPERTS, INTER, HIDDEN)),
                            ("ffn_down_exps", (EXPERTS, HIDDEN, INTER)), ("attn_q", (HIDDEN, HIDDEN)),
                            ("attn_k", (KV, HIDDEN)), ("attn_v", (KV, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN))):
            declare(f"blk.{i}.{part}.weight", shape)
        declare(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), f32)
        declare(f"blk.{i}.attn_norm.weight", (HIDDEN,), f32)
        declare(f"blk.{i}.ffn_norm.weight", (HIDDEN,), f32)
    declare("output_norm.weight", (HIDDEN,), f32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def _granite_safetensors(out: Path) -> Path:
    """An HF directory whose model.safetensors is only a header declaring the Granite checkpoint's bf16 tensors."""
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": [HIDDEN], p + "post_attention_layernorm.weight": [HIDDEN],
                   p + "self_attn.q_proj.weight": [HIDDEN, HIDDEN], p + "self_attn.k_proj.weight": [KV, HIDDEN],
                   p + "self_attn.v_proj.weight": [KV, HIDDEN], p + "self_attn.o_proj.weight": [HIDDEN, HIDDEN],
                   p + "block_sparse_moe.router.layer.weight": [EXPERTS, HIDDEN],
                   p + "block_sparse_moe.input_linear.weight": [EXPERTS, 2 * INTER, HIDDEN],
                   p + "block_sparse_moe.output_linear.weight": [EXPERTS, HIDDEN, INTER]}
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header).encode()
    out.mkdir()
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    return out


def test_headers_declare_the_elements_without_their_data(tmp_path: Path):
    smollm2 = read_header(resolve("smollm2"))  # the real file: its header only
    assert smollm2.architecture == "LlamaForCausalLM"
    assert sum(t.elements for t in smollm2.tensors) == 134_515_008
    assert smollm2.share_in(("Q4_1",)) == pytest.approx(106_168_320 / 134_515_008)
    assert not any(t.expert for t in smollm2.tensors)
    for header in (read_header(_granite_gguf(tmp_path / "granite.gguf")),
                   read_header(_granite_safetensors(tmp_path / "granite-hf"))):
        assert sum(t.elements for t in header.tensors) == GRANITE_ELEMENTS
        assert sum(t.elements for t in header.tensors if t.expert) == GRANITE_EXPERT_ELEMENTS
    assert read_header(tmp_path / "granite.gguf").architecture == "GraniteMoeForCausalLM"


def test_an_moe_gguf_is_estimated_from_its_header_and_gets_one_worker(tmp_path: Path):
    """Issue 35: the 1.42 GB Q8_0 Granite-shaped GGUF was estimated at ~34 GiB a worker from its size
    (x24); its worker holds 6.8 GiB (bf16 dense, the default on an AVX512-BF16 CPU). Two of them fit
    a 24 GiB host, but an MoE gets one: two would each read nearly every expert a step."""
    # a header-only file: converting it to resolve weight_format auto, as the engine does, would fail
    worker = estimate(_granite_gguf(tmp_path / "granite.gguf"), "auto", "auto", GIB, flags=ZEN4)
    assert worker.how == "bfloat16 dense" and 6.9 * GIB < worker.bytes < 1.5 * 6.8 * GIB and worker.moe
    shape = auto_shape(2, worker, HOST_24G)
    assert (shape.workers, shape.share_cores) == (1, False) and shape.why.startswith("an MoE")
    dense = auto_shape(2, dataclasses.replace(worker, moe=False), HOST_24G)  # the same bytes, no experts
    assert (dense.workers, dense.share_cores) == (2, True)
    assert "two workers want ~15.5 GiB (bfloat16 dense)" in dense.why


def test_a_host_too_small_for_two_keeps_one_and_says_the_estimate(tmp_path: Path):
    worker = estimate(_granite_safetensors(tmp_path / "granite-hf"), "auto", "auto", GIB, flags=AVX2)
    assert worker.how == "float32 dense" and 12.3 * GIB < worker.bytes < 1.5 * 12.2 * GIB  # 12.2 GiB measured
    shape = auto_shape(2, dataclasses.replace(worker, moe=False), HOST_24G)  # the memory, not the experts
    assert (shape.workers, shape.share_cores) == (1, False)
    assert shape.why == "22.0 GiB available, two workers want ~26.9 GiB (float32 dense)"


@pytest.mark.parametrize("flags, dtype, how, measured", [
    (ZEN4, "auto", "float32 on the GGUF's blocks", (1.6, 1.9)),  # (RssAnon peak, VmHWM) GiB, 1 GiB KV cache
    (ZEN4, "float32", "float32 dense", (2.9, 3.2)),
    (AVX2, "auto", "float32 dense", (2.9, 3.2)),
    (ZEN4, "bfloat16", "bfloat16 dense", (2.1, 2.3)),
])
def test_smollm2_still_gets_two_workers(flags, dtype, how, measured):
    worker = estimate(resolve("smollm2"), dtype, "auto", GIB, flags=flags)
    anon, hwm = measured
    assert worker.how == how and hwm * GIB < worker.bytes < 1.5 * anon * GIB
    assert auto_shape(2, worker, 8 * GIB).workers == 2
    assert auto_shape(16, worker, 20 * GIB).workers == 2
    assert auto_shape(2, worker, 4 * GIB).workers == 1


def test_auto_shares_the_cores_where_cores_and_memory_allow():
    shape = auto_shape(2, Estimate(3 * GIB, "float32 dense"), 20 * GIB)
    assert (shape.workers, shape.share_cores) == (2, True) and "2 cores" in shape.why


@pytest.mark.parametrize("cores, worker, mem, why", [
    (1, Estimate(3 * GIB, ""), 20 * GIB, "1 core"),
    (2, Estimate(5 * GIB, ""), 8 * GIB, "GiB available"),
    (2, None, 20 * GIB, "unknown"),
    (2, Estimate(3 * GIB, ""), None, "unknown"),
])
def test_auto_keeps_one_worker_otherwise(cores, worker, mem, why):
    shape = auto_shape(cores, worker, mem)
    assert (shape.workers, shape.share_cores) == (1, False) and why in shape.why


def test_a_model_without_a_header_read_is_estimated_from_its_size(tmp_path: Path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    worker = estimate(tmp_path, "auto", "auto", GIB, flags=ZEN4)
    assert worker.bytes == 1000 * FALLBACK_PER_FILE_BYTE + GIB + RUNTIME_BYTES and "file size" in worker.how
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 0))  # 5 tensors declared, none there
    assert read_header(tmp_path / "cut.gguf") is None
    assert estimate(tmp_path / "cut.gguf", "auto", "auto", GIB, flags=ZEN4).bytes == 24 * FALLBACK_PER_FILE_BYTE + 2 * GIB
    assert estimate(tmp_path / "missing", "auto", "auto", GIB) is None


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


def test_up_estimates_the_model_given_in_the_dtype_asked(monkeypatch, capsys, tmp_path: Path):
    hf = _granite_safetensors(tmp_path / "granite-hf")  # an MoE: one worker, its estimate said
    kw = _up(monkeypatch, ["--model", str(hf), "--dtype", "bfloat16"], mem=HOST_24G)
    assert kw["workers"] == 1 and "(one wants ~7.7 GiB, bfloat16 dense))" in capsys.readouterr().err
    kw = _up(monkeypatch, ["--model", str(hf), "--engine", '{"dtype": "float32"}'], mem=HOST_24G)
    assert kw["workers"] == 1 and "(one wants ~13.5 GiB, float32 dense))" in capsys.readouterr().err


def test_an_engine_burst_budget_given_is_kept(monkeypatch):
    kw = _up(monkeypatch, ["--engine", '{"burst_step_tokens": 768}'])
    assert kw["workers"] == 2 and kw["engine"]["burst_step_tokens"] == 768


def test_workers_takes_auto_or_a_count(monkeypatch, capsys):
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            main(["up", "--workers", bad])
        assert "--workers" in capsys.readouterr().err
