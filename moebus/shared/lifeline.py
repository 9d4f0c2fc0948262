"""Children that die with their parent: no orphans when a launcher is SIGKILLed.

Why PR_SET_PDEATHSIG and not a pipe the child watches: it covers children we cannot change
(nats-server) with the same few lines as our own services, and it needs no thread in the child.
The kernel sends the child a signal of the parent's choice when the parent dies, however it dies.
The launcher asks for SIGKILL: it only dies without stopping its children itself when it is killed
hard, and then a graceful drain is moot (nats-server goes at the same moment, so nothing could be
handed back), while a drain without a server could take its full timeouts. Linux only (elsewhere
this is a no-op).

Caveats, both handled here or by the callers:
- The "parent" is the *thread* that forked the child: spawn from a thread that lives as long as
  the children should (the launcher spawns from its main thread).
- A parent that dies between fork and prctl would be missed: the child compares its parent pid
  with the one it was forked from and stops itself when they differ.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this thread/process dies.
    None where the platform has no such thing (Popen then runs nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    # Resolved here, in the parent: the child (forked, maybe from a threaded parent) only makes
    # two system calls, no dlopen or imports.
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # this process's symbols: libc's prctl among them
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec
