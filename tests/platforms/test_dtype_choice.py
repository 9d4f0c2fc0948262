"""dtype="auto": bf16 only where the CPU has native bf16 dot products, fp32 otherwise; flags override."""
from __future__ import annotations

import logging

import pytest

from moebus.cli import build_parser
from moebus.engine.config import EngineConfig
from moebus.platforms.dtype_choice import choose_dtype, cpu_flags, resolve_dtype

# Flag sets as /proc/cpuinfo lists them on the machines this project has run on.
ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma bmi2 sha_ni".split()
ZEN4 = ZEN3 + "avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_vbmi2".split()
SAPPHIRE_RAPIDS = ZEN3 + "avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8".split()
AMX_ONLY = ZEN3 + "avx512f amx_tile amx_bf16".split()  # hypothetical: AMX without the AVX512 bf16 flag
AVX512_NO_BF16 = ZEN3 + "avx512f avx512bw avx512_vnni".split()  # Skylake-SP / Ice Lake


@pytest.mark.parametrize(("flags", "want"), [
    (ZEN3, "float32"), (AVX512_NO_BF16, "float32"), ([], "float32"),
    (ZEN4, "bfloat16"), (SAPPHIRE_RAPIDS, "bfloat16"), (AMX_ONLY, "bfloat16"),
])
def test_auto_follows_native_bf16(flags, want):
    choice = choose_dtype("auto", "cpu", flags)
    assert choice.dtype == want
    assert choice.reason.startswith("auto:")
    if want == "bfloat16":
        assert "bf16" in choice.reason
    else:
        assert "no native bf16" in choice.reason


@pytest.mark.parametrize("explicit", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_overrides_the_flags(explicit):
    for flags in (ZEN3, SAPPHIRE_RAPIDS):
        assert choose_dtype(explicit, "cpu", flags).dtype == explicit


def test_accelerator_auto_and_bad_names():
    assert choose_dtype("auto", "cuda:0", accel_bf16=True).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda:0", accel_bf16=False).dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be auto"):
        choose_dtype("fp8", "cpu", ZEN4)
    with pytest.raises(ValueError, match="dtype must be auto"):
        EngineConfig(dtype="half")


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: " + " ".join(ZEN4) + "\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == frozenset(ZEN4)
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_engine_config_resolves_auto_from_this_cpu_and_logs(caplog):
    native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    with caplog.at_level(logging.INFO, logger="moebus.platforms.dtype_choice"):
        cfg = EngineConfig(dtype="auto")
    assert cfg.dtype == ("bfloat16" if native else "float32")
    assert str(cfg.torch_dtype) == f"torch.{cfg.dtype}"
    assert any(f"compute dtype {cfg.dtype}" in r.getMessage() for r in caplog.records)
    assert EngineConfig().dtype == "float32"  # library default stays explicit; the CLIs default to auto
    assert resolve_dtype("bfloat16") == "bfloat16"


def test_cli_dtype_flags():
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x"]).dtype == "auto"
    assert p.parse_args(["generate", "--prompt", "x", "--dtype", "float32"]).dtype == "float32"
    assert p.parse_args(["up"]).dtype == "auto"
    assert p.parse_args(["up", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        p.parse_args(["up", "--dtype", "int4"])
