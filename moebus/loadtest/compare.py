"""`moebus loadtest compare A B ...`: runs side by side in one table and one figure."""
from __future__ import annotations

from pathlib import Path

from .plots import plot_compare
from .results import SUMMARY, read_json, read_records
from .summary import table


def compare(run_dirs: list[Path], out: Path | None = None, plots: bool = True) -> str:
    names = _names(run_dirs)
    summaries = {}
    for name, d in zip(names, run_dirs, strict=True):
        if not (d / SUMMARY).exists():
            raise FileNotFoundError(f"{d}: no {SUMMARY} (not a finished load test run)")
        summaries[name] = read_json(d / SUMMARY)
    text = table(summaries)
    if plots:
        path = out or (run_dirs[0].parent / "compare.png")
        plot_compare({n: read_records(d) for n, d in zip(names, run_dirs, strict=True)}, path)
        text += f"\nfigure: {path}"
    return text


def _names(run_dirs: list[Path]) -> list[str]:
    names = [d.name for d in run_dirs]
    if len(set(names)) < len(names):  # same leaf name: use the parent too
        names = [f"{d.parent.name}/{d.name}" for d in run_dirs]
    return names
