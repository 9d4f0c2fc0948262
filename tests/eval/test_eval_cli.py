"""`moebus eval` on bad input: exit 2 and one `error:` line, nothing loaded, no traceback."""
from __future__ import annotations

import pytest

from moebus.cli import main


def _fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_unknown_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert "'fp64'" in _fails(capsys, "--config", "fp32", "--config", "fp64")


def test_missing_model(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert "no-such.gguf" in _fails(capsys, "--model", str(tmp_path / "no-such.gguf"))
    assert "no-such-dir" in _fails(capsys, "--model", str(tmp_path / "no-such-dir"))


def test_model_that_fails_to_load(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")  # an HF dir without weights or tokenizer
    assert str(tmp_path) in _fails(capsys, "--model", str(tmp_path))


def test_missing_text_and_prompts(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert "no-such.txt" in _fails(capsys, "--text", str(tmp_path / "no-such.txt"))
    assert "prompts.txt" in _fails(capsys, "--prompts", str(tmp_path / "prompts.txt"))


def test_text_shorter_than_ctx(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    (tmp_path / "short.txt").write_text("# a header line\nFour score and seven years ago.\n")
    assert "fewer than --ctx 512" in _fails(capsys, "--text", str(tmp_path / "short.txt"))


def test_tiny_v4_rows_need_the_tiny_v4_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert "needs --model tiny-v4" in _fails(capsys, "--config", "fp32", "--config", "v4-ep2")
