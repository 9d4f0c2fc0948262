"""Every engine a worker runs satisfies the engine port (moebus.engine.port), and the real engine
what the KV code asks of it (moebus.kv.host), structurally: each member the port declares is
there, with a compatible signature (checked on the classes, so the expert-parallel DPEngine needs
no process group), and live instances pass the runtime checks."""
from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Protocol

import pytest

from moebus.devmodel.toy import ToyEngine, ToyOutput
from moebus.engine.distributed.dp_engine import DPEngine
from moebus.engine.llm_engine import LLMEngine
from moebus.engine.outputs import RequestOutput
from moebus.engine.port import EngineOutput, EnginePort, LockstepEngine
from moebus.engine.scheduler import Scheduler
from moebus.kv.connector import KVConnector
from moebus.kv.connector_port import KVConnectorPort, SchedulerKV
from moebus.kv.host import KVHost, KVScheduler, PrefillHost

_PROTOCOL_NOISE = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__", "__weakref__",
                   "__dict__", "__doc__", "__module__", "__annotations__", "__parameters__", "__orig_bases__",
                   "__protocol_attrs__", "__non_callable_proto_members__", "__abstractmethods__", "_abc_impl",
                   "_is_protocol", "_is_runtime_protocol", "__slots__", "__qualname__", "__firstlineno__",
                   "__static_attributes__"}


_MISSING = object()


def _annotations(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


def _members(proto: type) -> tuple[dict[str, object], set[str]]:
    """(methods and properties, plain data members) the protocol declares, its bases' included."""
    methods: dict[str, object] = {}
    for klass in proto.__mro__:
        if klass is object or klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if name not in _PROTOCOL_NOISE and (callable(value) or isinstance(value, property)):
                methods.setdefault(name, value)
    return methods, _annotations(proto) - set(methods)


def _compatible(impl: object, spec: object) -> str | None:
    """None when impl's signature accepts every call spec's does (same names, kinds and defaults;
    extra parameters only with defaults)."""
    got, want = inspect.signature(impl), inspect.signature(spec)
    have = list(got.parameters.values())
    for i, p in enumerate(want.parameters.values()):
        if i >= len(have) or have[i].name != p.name or have[i].kind != p.kind:
            return f"parameter {i} should be {p}, got {have[i] if i < len(have) else 'nothing'}"
        if p.default is not inspect.Parameter.empty and have[i].default is inspect.Parameter.empty:
            return f"{p.name} needs a default"
    extra = [p for p in have[len(want.parameters):] if p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"extra required parameters {extra}" if extra else None


def _conformance(cls: type, proto: type) -> list[str]:
    problems = []
    methods, data = _members(proto)
    for name, spec in methods.items():
        impl = inspect.getattr_static(cls, name, _MISSING)
        if impl is _MISSING and name not in _annotations(cls):
            problems.append(f"{name} missing")
        elif isinstance(spec, property):
            if callable(impl) and not isinstance(impl, property):
                problems.append(f"{name} should be an attribute or property")
        elif not callable(impl):
            problems.append(f"{name} should be a method")
        elif (why := _compatible(getattr(cls, name), spec)) is not None:
            problems.append(f"{name}: {why}")
    for name in data:
        if inspect.getattr_static(cls, name, _MISSING) is _MISSING and name not in _annotations(cls):
            problems.append(f"{name} is neither set on the class nor declared in its annotations")
    return problems


@pytest.mark.parametrize(("cls", "proto"), [
    (LLMEngine, EnginePort), (DPEngine, EnginePort), (DPEngine, LockstepEngine), (ToyEngine, EnginePort),
    (RequestOutput, EngineOutput), (ToyOutput, EngineOutput), (KVConnector, KVConnectorPort),
    (KVConnector, SchedulerKV),
    (LLMEngine, KVHost), (LLMEngine, PrefillHost), (Scheduler, KVScheduler),
], ids=lambda x: x.__name__)
def test_class_satisfies_the_port(cls: type, proto: type) -> None:
    assert _conformance(cls, proto) == []


def test_the_check_catches_a_mismatch() -> None:
    class Wrong:
        lockstep = False
        tokenizer = None
        failed_steps_in_a_row = 0
        kv = None

        def add_request(self, request_id, prompt, params):  # renamed parameter, no priority
            ...

    problems = _conformance(Wrong, EnginePort)
    assert any(p.startswith("add_request") for p in problems) and any("step missing" in p for p in problems)


def test_live_engines_pass_the_runtime_checks(llm) -> None:
    toy, real = ToyEngine(), llm.engine
    for engine in (toy, real):
        assert isinstance(engine, EnginePort) and not engine.lockstep
    assert toy.kv is None and isinstance(real.kv, KVConnectorPort)
    assert isinstance(real, PrefillHost) and isinstance(real.scheduler, KVScheduler)
    assert isinstance(RequestOutput("r", [], "", False), EngineOutput)
    assert isinstance(ToyOutput("r", [], False, None, 0), EngineOutput)


def test_the_port_and_the_toy_engine_import_without_torch() -> None:
    code = ("import sys\nimport moebus.engine.port, moebus.devmodel.toy\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
