"""The operator's CLI (#19 item 6): every flag of `up` and `serve` has help text and its default,
`--version`, first-class --max-model-len / --enable-prefix-caching / --log-format, --workers
splitting the cores between the workers' torch threads, --api-key-file and --metrics-host."""
from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

import moebus
from moebus.cli import build_parser, main
from moebus.services import cli as services_cli
from moebus.services.startup import threads_per_worker
from moebus.shared.config_cli import add_model_args, field_comments
from moebus.shared.logs import LOG_FORMAT_ENV


def _sub(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


@pytest.mark.parametrize("command", ["up", "serve"])
def test_every_flag_has_help_and_its_default(command: str) -> None:
    parser = _sub(command)
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
    assert text.count("(default:") >= len([a for a in parser._actions if a.option_strings]) - 1  # -h has none


def test_service_flags_say_what_they_are() -> None:
    from moebus.services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    add_model_args(parser, WorkerConfig)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["max_queued"].startswith("requests waiting for their first token")
    assert helps["heartbeat_interval_s"].startswith("seconds between heartbeats")  # from the base class
    assert helps["warmup"].endswith("(default: True)")
    assert "drain_grace_s" in field_comments(WorkerConfig)


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"moebus {moebus.__version__}"


def _up_kwargs(monkeypatch, argv: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(services_cli, "up", lambda **kw: seen.update(kw) or 0)
    monkeypatch.setenv(LOG_FORMAT_ENV, "text")
    if "--workers" not in argv:  # one worker: --workers auto's choice depends on the host (test_fleet_shape.py)
        argv = ["--workers", "1", *argv]
    assert main(["up", *argv]) == 0
    return seen


def _engine(kw: dict[str, Any]) -> dict[str, Any]:
    # --dtype and --weight-format (default auto) always go in
    return {k: v for k, v in kw["engine"].items() if k not in ("dtype", "weight_format")}


def test_first_class_engine_flags(monkeypatch) -> None:
    kw = _up_kwargs(monkeypatch, ["--max-model-len", "2048", "--no-enable-prefix-caching",
                                  "--engine", '{"max_num_seqs": 8}', "--log-format", "json"])
    assert _engine(kw) == {"max_num_seqs": 8, "max_model_len": 2048, "enable_prefix_caching": False}
    assert os.environ[LOG_FORMAT_ENV] == "json"
    kw = _up_kwargs(monkeypatch, ["--enable-prefix-caching"])
    assert _engine(kw) == {"enable_prefix_caching": True}
    assert _engine(_up_kwargs(monkeypatch, [])) == {}  # the engine's own defaults
    assert _up_kwargs(monkeypatch, [])["engine"]["weight_format"] == "auto"
    assert _up_kwargs(monkeypatch, ["--weight-format", "dense"])["engine"]["weight_format"] == "dense"
    kw = _up_kwargs(monkeypatch, ["--weight-format", "dense", "--engine", '{"weight_format": "gguf"}'])
    assert kw["engine"]["weight_format"] == "gguf"  # --engine's fields win, as for dtype


def test_workers_split_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    assert threads_per_worker(1) is None and threads_per_worker(2) == 4 and threads_per_worker(3) == 2
    assert threads_per_worker(16) == 1  # never 0
    assert _up_kwargs(monkeypatch, ["--workers", "2"])["worker"] == {"torch_threads": 4}
    assert _up_kwargs(monkeypatch, ["--workers", "2", "--torch-threads", "3"])["worker"] == {"torch_threads": 3}
    disagg = _up_kwargs(monkeypatch, ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "3"])
    assert disagg["worker"] == {"torch_threads": 2}
    assert _up_kwargs(monkeypatch, ["--workers", "2", "--model", "toy"])["worker"] == {}  # no torch there


def test_api_key_flags_and_listener_hosts(monkeypatch, capsys) -> None:
    kw = _up_kwargs(monkeypatch, ["--api-key-file", "keys.txt"])
    assert (kw["api_keys"], kw["api_keys_file"], kw["metrics_host"]) == ([], "keys.txt", "127.0.0.1")
    assert "warning" not in capsys.readouterr().err
    kw = _up_kwargs(monkeypatch, ["--api-key", "sk-1", "--metrics-host", "0.0.0.0"])
    assert (kw["api_keys"], kw["metrics_host"]) == (["sk-1"], "0.0.0.0")
    err = capsys.readouterr().err
    assert "`ps` shows it" in err and "sk-1" not in err


@pytest.mark.parametrize("argv,says", [(["--engine", "{weight_format: gguf}"], "--engine is not valid JSON"),
                                       (["--worker", "[1]"], "--worker must be a JSON object")])
def test_a_bad_json_flag_exits_with_one_line(monkeypatch, argv, says) -> None:
    monkeypatch.setattr(services_cli, "up", lambda **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        main(["up", "--workers", "1", *argv])
    assert says in str(e.value.code)
