"""Grammar compiles off the engine thread (compile_pool.py): in a child process, under a deadline
past which the child is killed and the request refused; grammars and refusals cached; a flood
refused at once rather than queued. On the real SmolLM2 tokenizer (each child start imports
xgrammar and torch: a few seconds)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from moebus.engine.port import RequestRefused
from moebus.engine.sampling import StructuredOutputCompiler, StructuredOutputConfig, StructuredOutputParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

DEADLINE_S = 1.0
# Measured (xgrammar 0.2.9, one compile thread): ~1,000 optional properties compile in ~2 s, 2,000
# in ~22 s, 3,000 in more than a minute: cubic, and only ~33 KB of JSON (the API allows 64 KB).
NEVER = {"type": "object", "properties": {str(i): {} for i in range(3000)}}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    cfg = StructuredOutputConfig(max_threads=1, compile_timeout_s=DEADLINE_S, max_pending_compiles=2)
    c = StructuredOutputCompiler(smollm2_tokenizer, len(smollm2_tokenizer) + 64, config=cfg)
    c.compile_async(StructuredOutputParams(regex="warm")).result(120)  # the child's start, once
    yield c
    c.close()


def test_a_compile_is_cached_and_masks_as_the_in_process_one(compiler, smollm2_tokenizer) -> None:
    params = StructuredOutputParams(regex="[0-9]{3}-[a-z]+")
    got = compiler.compile_async(params).result(30)
    again = compiler.compile_async(params)
    assert again.done() and again.result() is got  # settled at once, the same grammar
    theirs = compiler.new_state(params)
    assert theirs.grammar is got  # from the cache
    local = StructuredOutputCompiler(smollm2_tokenizer, compiler.vocab_size,
                                     config=StructuredOutputConfig(max_threads=1, cache_size=0))
    mine = local.new_state(params)
    for t in smollm2_tokenizer.encode("123-ab", add_special_tokens=False):
        assert (mine.allowed_mask() == theirs.allowed_mask()).all()
        assert mine.accept_token(t) and theirs.accept_token(t)
    assert (mine.allowed_mask() == theirs.allowed_mask()).all() and theirs.is_completed()


def test_an_invalid_one_is_refused_and_remembered(compiler) -> None:
    params = StructuredOutputParams(regex="(a")
    with pytest.raises(RequestRefused, match="invalid regex: .*parenthesis") as e:
        compiler.compile_async(params).result(30)
    assert not e.value.retryable
    assert compiler.compile_async(params).done()  # the refusal is cached
    with pytest.raises(RequestRefused, match="invalid regex"):
        compiler.compile(params)  # and the in-process path sees it too


def test_past_the_deadline_the_child_is_killed_and_the_next_compile_works(compiler) -> None:
    params = StructuredOutputParams(json_schema=NEVER)
    assert len(json.dumps(NEVER)) < 64 * 1024
    started = time.monotonic()
    with pytest.raises(RequestRefused, match=f"compiling the JSON schema took longer than {DEADLINE_S:g}s"):
        compiler.compile_async(params).result(30)
    took = time.monotonic() - started
    assert DEADLINE_S <= took < 10 * DEADLINE_S, took  # CPU seconds: on a busy host more of the clock
    assert compiler._pool.timeouts == 1
    cached = compiler.compile_async(params)
    assert cached.done() and isinstance(cached.exception(), RequestRefused)  # not compiled again
    assert compiler.compile_async(StructuredOutputParams(choice=["yes", "no"])).result(60).kind == "choice"


def test_a_flood_is_refused_at_once_and_retryably(compiler) -> None:
    floods = [compiler.compile_async(StructuredOutputParams(regex=f"flood{i}[a-z]{{1,{9000 + i}}}"))
              for i in range(4)]  # distinct keys: two wait, the rest are refused on the spot
    busy = [f for f in floods if f.done() and isinstance(f.exception(), RequestRefused)]
    assert len(busy) >= 2 and all(f.exception().retryable for f in busy)
    assert "busy" in str(busy[0].exception())
    for f in floods:
        f.exception(60)  # all settle


def test_a_child_that_gets_no_cpu_is_busy_not_a_refusal(compiler) -> None:
    """The deadline is CPU time: a starved child (here stopped) is not the grammar's fault; past the
    wall cap the job is refused retryably and nothing is remembered."""
    pool = compiler._pool
    pool._warm()  # the child of the last kill is up
    (child,) = pool._live
    params = StructuredOutputParams(regex="starved[0-9]+")
    wall, pool.wall_s = pool.wall_s, 1.0
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RequestRefused, match="busy") as e:
            compiler.compile_async(params).result(30)
    finally:
        pool.wall_s = wall
        if child.alive:
            os.kill(child.proc.pid, signal.SIGCONT)
    assert e.value.retryable and not child.alive
    assert compiler.compile_async(params).result(60).kind == "regex"  # asked again: compiled
