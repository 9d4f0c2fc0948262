"""The CPU cores this process may run on: what the launcher splits between workers and what
workers that share the cores (platforms/cpu/core_share.py) divide by turns."""
from __future__ import annotations

import os


def usable_cores() -> int:
    """Its affinity mask's size where the OS has one, else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
