"""PNG plots of one run (latency CDFs, throughput and in-flight over time, TTFT over time) and
of several runs side by side. matplotlib is imported here only (the `loadtest` extra)."""
from __future__ import annotations

from pathlib import Path

from .client import RequestRecord


def _bin(end: float) -> float:
    """About 60 bins over the run, 0.1 s to 10 s each."""
    return min(10.0, max(0.1, end / 60))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, xs: list[float], label: str) -> None:
    xs = sorted(xs)
    if xs:
        ax.plot([1000 * x for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def _token_times(r: RequestRecord) -> list[float]:
    if r.ttft_s is None:
        return []
    t = r.sent_s + r.ttft_s
    times = [t]
    for g in r.itl_s:
        t += g
        times.append(t)
    return times


def _series(records: list[RequestRecord]) -> tuple[list[float], list[float], list[float]]:
    """Bin starts, output tok/s and finished req/s per bin."""
    end = max((r.done_s or r.sent_s for r in records), default=0.0)
    w = _bin(end)
    n = int(end / w) + 1
    toks, done = [0.0] * n, [0.0] * n
    for r in records:
        times = _token_times(r)
        per_chunk = (r.completion_tokens or len(times)) / len(times) if times else 0.0
        for t in times:
            toks[min(int(t / w), n - 1)] += per_chunk / w
        if r.ok and r.done_s is not None:
            done[min(int(r.done_s / w), n - 1)] += 1 / w
    return [b * w for b in range(n)], toks, done


def _in_flight(records: list[RequestRecord]) -> tuple[list[float], list[int]]:
    """The exact step function: +1 at each send, -1 at each finish."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.done_s, -1) for r in records if r.done_s is not None])
    t, level, out = [0.0], 0, [0]
    for when, d in events:
        level += d
        t.append(when)
        out.append(level)
    return t, out


def plot_run(records: list[RequestRecord], out_dir: Path, title: str = "") -> list[Path]:
    plt = _plt()
    ok = [r for r in records if r.ok]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, name, xs in zip(axes, ("TTFT", "ITL (all gaps)", "E2E"),
                            ([r.ttft_s for r in ok if r.ttft_s is not None], [g for r in ok for g in r.itl_s],
                             [r.e2e_s for r in ok if r.e2e_s is not None]), strict=True):
        _cdf(ax, xs, title or "run")
        ax.set(title=f"{name} CDF", xlabel="ms",
               ylabel="fraction of gaps" if name.startswith("ITL") else "fraction of requests")
        ax.grid(alpha=0.3)
    paths.append(_save(plt, fig, out_dir / "latency_cdf.png", title))

    t, toks, done = _series(records)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(t, toks, where="post", label="output tok/s")
    ax.set(xlabel="s since start", ylabel="output tok/s")
    ax2 = ax.twinx()
    ft, flight = _in_flight(records)
    ax2.step(ft, flight, where="post", color="tab:orange", label="in flight")
    ax2.step(t, done, where="post", color="tab:green", alpha=0.6, label="finished req/s")
    ax2.set(ylabel="requests")
    fig.legend(loc="upper right")
    paths.append(_save(plt, fig, out_dir / "throughput.png", title))

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.scatter([r.sent_s for r in ok if r.ttft_s is not None], [1000 * r.ttft_s for r in ok if r.ttft_s is not None],
               s=6)
    bad = [r for r in records if not r.ok]
    if bad:
        ax.scatter([r.sent_s for r in bad], [0] * len(bad), marker="x", color="red", label="failed")
        ax.legend()
    ax.set(title="TTFT over time", xlabel="send time, s since start", ylabel="TTFT ms")
    ax.grid(alpha=0.3)
    paths.append(_save(plt, fig, out_dir / "ttft_over_time.png", title))
    return paths


def plot_compare(runs: dict[str, list[RequestRecord]], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for name, records in runs.items():
        ok = [r for r in records if r.ok]
        _cdf(axes[0][0], [r.ttft_s for r in ok if r.ttft_s is not None], name)
        _cdf(axes[0][1], [g for r in ok for g in r.itl_s], name)
        _cdf(axes[1][0], [r.e2e_s for r in ok if r.e2e_s is not None], name)
        t, toks, _ = _series(records)
        axes[1][1].step(t, toks, where="post", label=name)
    for ax, title, xl in ((axes[0][0], "TTFT CDF", "ms"), (axes[0][1], "ITL (all gaps) CDF", "ms"), (axes[1][0], "E2E CDF", "ms"),
                          (axes[1][1], "output tok/s over time", "s since start")):
        ax.set(title=title, xlabel=xl)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(plt, fig, path, "")


def _save(plt, fig, path: Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
