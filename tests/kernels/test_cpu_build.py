import pytest

from moebus.kernels import cpu_build

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow


def test_build_is_cached_per_source_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_CACHE", str(tmp_path))
    first = cpu_build.build("paged_attention_cpu.c")
    if first is None:
        pytest.skip("no C compiler")
    assert first.parent == tmp_path / "kernels" and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build("paged_attention_cpu.c") == first and first.stat().st_mtime_ns == mtime
    lib = cpu_build.CpuLibrary("paged_attention_cpu.c").get()
    assert lib is not None and hasattr(lib, "paged_decode_bf16")


def test_no_compiler_or_disabled_falls_back_to_none(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBUS_CACHE", str(tmp_path))
    assert cpu_build.build("paged_attention_cpu.c", cc=str(tmp_path / "no-such-cc")) is None
    monkeypatch.setenv("MOEBUS_DISABLE_CPU_KERNELS", "1")
    assert cpu_build.build("paged_attention_cpu.c") is None
    assert cpu_build.CpuLibrary("paged_attention_cpu.c").get() is None
