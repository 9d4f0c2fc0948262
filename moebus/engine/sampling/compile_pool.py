"""Grammar compiles in child processes, each under a deadline.

xgrammar compiles in native code that cannot be interrupted, and some inputs well within the API's
size bounds compile for minutes (a schema with a few thousand optional properties). On a thread
such a compile would hold a core and its memory long after its request was refused; a child
process is killed at the deadline instead, and a fresh one started at once for the next job.

The deadline is on the child's CPU time (one compile thread: seconds of work, whatever else the
host runs), so a busy host does not turn a trivial grammar into a refusal; the wall clock only
caps the wait at `wall_factor` times the deadline, and a job killed by that cap, or whose child
would not start, is `CompilerBusy` (for now, not the grammar's fault), as is a job past
`max_pending` waiting (refused at once rather than queued behind compiles that may each take the
whole deadline). The compiled grammar comes back serialized (xgrammar JSON); the caller
deserializes it.
"""
from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .compile_child import CompileJob, read_frame, write_frame

log = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parents[3])  # the directory moebus is imported from
_TICK_S = 0.05  # how often a waiting job looks at its child's CPU time


class CompileTimeout(Exception):
    """The compile used more CPU than its deadline (its child was killed)."""


class CompilerBusy(Exception):
    """Not now: too many compiles waiting, the host too busy to finish one, or no child starting."""


class CompileFailed(Exception):
    """xgrammar refused the input (its message), or the child died compiling it."""


class CompilePool:
    def __init__(self, tokenizer_info_json: str, *, timeout_s: float, procs: int = 1, max_pending: int = 8,
                 wall_factor: float = 10.0, start_timeout_s: float = 120.0) -> None:
        if timeout_s <= 0 or procs < 1 or max_pending < 1 or wall_factor < 1:
            raise ValueError("timeout_s must be > 0, procs and max_pending >= 1, wall_factor >= 1")
        self.timeout_s, self.max_pending, self.start_timeout_s = timeout_s, max_pending, start_timeout_s
        self.wall_s = wall_factor * timeout_s
        self._info = tokenizer_info_json.encode()
        self._executor = ThreadPoolExecutor(procs, thread_name_prefix="moebus-grammar")
        self._idle: queue.SimpleQueue[_Child | None] = queue.SimpleQueue()  # one per executor thread
        for _ in range(procs):
            self._idle.put(None)  # started on first use
        self._live: set[_Child] = set()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self.timeouts = 0  # jobs killed at the deadline (for tests and stats)

    def submit(self, job: CompileJob) -> Future[str]:
        """The job's compiled grammar (xgrammar JSON); the future raises CompileTimeout,
        CompileFailed or CompilerBusy (this last one maybe at once)."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise CompilerBusy(f"{self._pending} grammars are already waiting to compile")
            self._pending += 1
        fut = self._executor.submit(self._run, job)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1

    def _run(self, job: CompileJob) -> str:
        child = self._idle.get()
        try:
            if child is None:
                child = self._start()
            return child.compile(job, self.timeout_s, self.wall_s)
        except CompileTimeout:
            self.timeouts += 1
            raise
        finally:
            if child is not None and not child.alive:
                with self._lock:
                    self._live.discard(child)
                child = None
                if not self._closed:
                    self._executor.submit(self._warm)  # its replacement starts now, not with the next job
            self._idle.put(child)

    def _warm(self) -> None:
        child = self._idle.get()
        try:
            if child is None:
                child = self._start()
        except Exception:  # the next job tries again
            log.warning("starting a grammar compile child failed", exc_info=True)
        finally:
            self._idle.put(child)

    def _start(self) -> _Child:
        child = _Child(self._info, self.start_timeout_s)
        with self._lock:
            if not self._closed:
                self._live.add(child)
                return child
        child.kill()
        raise CompilerBusy("the grammar compiler is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            children, self._live = list(self._live), set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for child in children:
            child.kill()


class _Child:
    """One compile child process and the pipes to it."""

    def __init__(self, info: bytes, start_timeout_s: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "moebus.engine.sampling.compile_child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        try:
            write_frame(self.proc.stdin, info)
            ready = select.select([self.proc.stdout], [], [], start_timeout_s)[0]
            if not ready or read_frame(self.proc.stdout.fileno()) != b"r":
                raise CompilerBusy(f"no grammar compiler started in {start_timeout_s:g}s")
        except (OSError, EOFError) as e:
            self.kill()
            raise CompilerBusy(f"the grammar compiler did not start ({e})") from None
        except BaseException:
            self.kill()
            raise
        log.info("grammar compile child %d started in %.1fs", self.proc.pid, time.monotonic() - started)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, job: CompileJob, cpu_s: float, wall_s: float) -> str:
        """The answer within cpu_s of the child's CPU time and wall_s of the clock, else killed."""
        fd, cpu0, started = self.proc.stdout.fileno(), self._cpu(), time.monotonic()
        try:
            write_frame(self.proc.stdin, job.encode())
            while not select.select([fd], [], [], _TICK_S)[0]:
                if self._cpu() - cpu0 > cpu_s:  # native code cannot be interrupted: the process goes
                    self.kill()
                    raise CompileTimeout(f"more than {cpu_s:g}s of CPU")
                if time.monotonic() - started > wall_s:
                    self.kill()
                    raise CompilerBusy(f"the host is too busy: no compile finished in {wall_s:g}s")
            frame = read_frame(fd)
        except (OSError, EOFError):
            self.kill()
            raise CompileFailed(f"the grammar compiler crashed on it (exit code {self.proc.returncode})") from None
        if frame[:1] == b"e":
            raise CompileFailed(frame[1:].decode(errors="replace"))
        return frame[1:].decode()

    def _cpu(self) -> float:
        """The child's CPU seconds (user + system; Linux /proc), or its age where there is no /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()
