"""glibc malloc thresholds for the engine on CPU (platforms/cpu/malloc.py): glibc takes them (mallopt's
own answer, which the engine logs), and an engine on CPU applies them unless told not to."""
from __future__ import annotations

import platform

import pytest

from moebus.platforms.cpu.malloc import tune_malloc

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


@glibc
def test_the_thresholds_are_taken() -> None:
    assert tune_malloc() is True


def test_the_engine_tunes_malloc_on_cpu_unless_told_not_to(monkeypatch) -> None:
    import moebus.engine.llm_engine as llm_engine
    from moebus.engine.config import EngineConfig
    from moebus.platforms.cpu.platform import CpuPlatform

    calls: list[int] = []

    class Stop(Exception):
        pass

    def load_model(*_a, **_k):
        raise Stop  # the rest of the engine's construction is not what this checks

    monkeypatch.setattr(CpuPlatform, "tune_malloc", lambda self: calls.append(1))
    monkeypatch.setattr(llm_engine, "load_model", load_model)
    for on in (True, False):
        with pytest.raises(Stop):
            llm_engine.LLMEngine(EngineConfig(tune_malloc=on))
    assert calls == [1]
