"""The grammar compile child (`python -m moebus.engine.sampling.compile_child`) and its protocol.

One xgrammar compile at a time, on one thread (the parent's deadline is on this process's CPU
time, and the host's other cores belong to the engine), each asked for by its parent
(compile_pool.py) over stdin and answered over stdout. Frames are a 4-byte big-endian length and
a body; the parent sends the serialized TokenizerInfo, then one JSON CompileJob per frame; the
child answers `r` (ready) once, then per job `o` + the compiled grammar's xgrammar JSON, or `e` +
the error. The dispatch from a job to xgrammar's calls lives here, the in-process compile uses it too.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import sys
from dataclasses import asdict, dataclass, field
from typing import IO, Any

_HEADER = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class CompileJob:
    kind: str  # json_schema | regex | grammar (json_object and choice arrive as these)
    source: str
    options: dict[str, Any] = field(default_factory=dict)  # compile_json_schema's keywords

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> CompileJob:
        return cls(**json.loads(data))


def compile_job(compiler: Any, job: CompileJob) -> Any:
    """The job compiled by an xgr.GrammarCompiler: an xgr.CompiledGrammar (RuntimeError: invalid)."""
    if job.kind == "json_schema":
        return compiler.compile_json_schema(job.source, **job.options)
    if job.kind == "regex":
        return compiler.compile_regex(job.source)
    return compiler.compile_grammar(job.source)


def write_frame(out: IO[bytes], body: bytes) -> None:
    out.write(_HEADER.pack(len(body)) + body)
    out.flush()


def read_frame(fd: int) -> bytes:
    """One frame from a raw file descriptor (EOFError: the other side is gone)."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return _read_exact(fd, size)


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        got = os.read(fd, min(left, 1 << 20))
        if not got:
            raise EOFError("compile child pipe closed")
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _die_with_parent() -> None:
    """Linux: SIGKILL when the thread that started this process ends (its pool's, so the worker's
    too): a worker killed outright leaves no compile running on for minutes."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed stdin ends it after its compile
        pass


def main() -> None:
    _die_with_parent()
    # The protocol owns the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(read_frame(0).decode()), max_threads=1)
    write_frame(out, b"r")
    while True:
        try:
            job = CompileJob.decode(read_frame(0))
        except EOFError:  # the parent closed the pipe or died
            return
        try:
            answer = b"o" + compile_job(compiler, job).serialize_json().encode()
        except Exception as e:  # xgrammar reports every parse / conversion error as RuntimeError
            answer = b"e" + str(e).encode(errors="replace")
        write_frame(out, answer)


if __name__ == "__main__":
    sys.exit(main())
