"""`moebus status`: every process of a running stack, with its state, load and restarts.

The frontend hears every instance's heartbeats on the bus (workers' carry their load: queue, KV,
prefix cache counts, TTFT/ITL percentiles; every beat says how often the supervisor restarted it)
and exports them as the `moebus_frontend_fleet_*` gauges on its /metrics (frontend/fleet/fleet.py);
this command scrapes that page: the API URL is all it needs (no bus credentials) and
/metrics needs no API key. A targets file (`moebus up --log-dir`) adds the processes the frontend
never heard, as missing, and when the frontend cannot be read (a stack starting: the frontend
starts last; or it is down) each process's own readiness probe says ready, starting or missing.
An unreachable stack is one line on stderr and exit code 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TextIO

from moebus.shared.fleet_status import InstanceStatus, from_text

DEFAULT_URL = "http://127.0.0.1:8000"  # `moebus up`'s default API


class Unreachable(Exception):
    """The stack's frontend could not be scraped (the one line the command prints)."""


def metrics_url(url: str) -> str:
    """The /metrics page behind an API URL, as `moebus up` prints it (`.../v1`) or bare."""
    base = url.rstrip("/").removesuffix("/v1").rstrip("/")
    return base + "/metrics"


def fetch(url: str, timeout_s: float) -> list[InstanceStatus]:
    page = metrics_url(url)
    try:
        with urllib.request.urlopen(page, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise Unreachable(f"{page} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"cannot reach {page}: {reason} (is the stack up?)") from None
    try:
        return from_text(text)
    except ValueError as e:  # another server, or a frontend from before the fleet gauges
        raise Unreachable(f"{page} is not a moebus frontend's metrics page ({e})") from None


class Target(NamedTuple):
    """One process in `moebus up`'s Prometheus targets file."""

    instance_id: str
    service: str
    address: str  # host:port of its /metrics and readiness probe


def read_targets(path: str) -> list[Target]:
    try:
        entries = json.loads(Path(path).read_text())
        return [Target(e["labels"]["instance_id"], e["labels"]["service"], e["targets"][0]) for e in entries]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise Unreachable(f"cannot read the targets file {path}: {e}") from None


def with_targets(rows: list[InstanceStatus], targets: list[Target]) -> list[InstanceStatus]:
    """Rows plus a `missing` one for every process in the targets file the frontend never heard."""
    heard = {r.instance_id for r in rows}
    extra = [InstanceStatus(instance_id=t.instance_id, service=t.service, state="missing")
             for t in targets if t.instance_id not in heard]
    return sorted([*rows, *extra], key=lambda r: (r.service, r.instance_id))


def probed(targets: list[Target], timeout_s: float) -> list[InstanceStatus]:
    """Without the frontend's view: each process's own readiness probe (the frontend's is /ready on its
    API port): 200 ready, another answer starting, none missing. No load, no restarts."""
    rows = []
    for t in targets:
        path = "/ready" if t.service == "frontend" else "/readyz"
        try:
            with urllib.request.urlopen(f"http://{t.address}{path}", timeout=timeout_s):
                state = "ready"
        except urllib.error.HTTPError:
            state = "starting"
        except (urllib.error.URLError, OSError, ValueError):
            state = "missing"
        rows.append(InstanceStatus(instance_id=t.instance_id, service=t.service, state=state))
    return sorted(rows, key=lambda r: (r.service, r.instance_id))


def collect(url: str, targets_file: str | None, timeout_s: float) -> tuple[list[InstanceStatus], str | None]:
    """The rows, and why they come from the probes instead of the frontend (None: they do not).
    Unreachable: no frontend and no targets file to fall back on."""
    targets = read_targets(targets_file) if targets_file is not None else None
    try:
        rows = fetch(url, timeout_s)
    except Unreachable as e:
        if targets is None:
            raise
        return probed(targets, min(timeout_s, 2.0)), f"{e}; states from each process's readiness probe"
    return (rows if targets is None else with_targets(rows, targets)), None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(a: float | None, b: float | None) -> str:
    return "-" if a is None and b is None else "/".join("-" if x is None else f"{1000 * x:.0f}" for x in (a, b))


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


COLUMNS: list[tuple[str, Callable[[InstanceStatus], str]]] = [
    ("INSTANCE", lambda r: r.instance_id),
    ("SERVICE", lambda r: r.service),
    ("STATE", lambda r: r.state),
    ("RESTARTS", lambda r: str(r.restarts)),
    ("RUNNING", lambda r: _num(r.running)),
    ("WAITING", lambda r: _num(r.waiting)),
    ("TOK/S", lambda r: _num(r.output_tokens_per_s, "{:.1f}")),
    ("KV", lambda r: _pct(r.kv_usage)),
    ("PREFIX HIT", lambda r: _pct(r.prefix_cache_hit_rate)),
    ("TTFT p50/p90 ms", lambda r: _ms(r.ttft_p50_s, r.ttft_p90_s)),
    ("ITL p50/p90 ms", lambda r: _ms(r.itl_p50_s, r.itl_p90_s)),
    ("LAST BEAT", lambda r: "never" if r.heartbeat_age_s is None else f"{r.heartbeat_age_s:.1f}s ago"),
]


def table(rows: list[InstanceStatus]) -> str:
    cells = [[name for name, _ in COLUMNS], *([cell(r) for _, cell in COLUMNS] for r in rows)]
    widths = [max(len(row[k]) for row in cells) for k in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    if not rows:
        lines.append("(no instance heard yet: the stack is starting)")
    return "\n".join(lines)


def render(rows: list[InstanceStatus], url: str, as_json: bool) -> str:
    if as_json:
        return json.dumps({"url": url, "instances": [r.model_dump() for r in rows]})
    return table(rows)


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
        sleep: Callable[[float], None] = time.sleep) -> int:
    """Exit code 1 when the frontend could not be read (with a targets file, the probes' table is printed)."""
    if args.watch is None:
        try:
            rows, fallback = collect(args.url, args.targets, args.timeout)
        except Unreachable as e:
            print(f"moebus status: {e}", file=err, flush=True)
            return 1
        print(render(rows, args.url, args.json), file=out, flush=True)
        if fallback is not None:
            print(f"moebus status: {fallback}", file=err, flush=True)
        return 0 if fallback is None else 1
    clear = not args.json and out.isatty()  # a terminal: redraw in place; a pipe: one table after another
    try:
        while True:
            text = note = None
            try:  # a frontend restarting: keep watching
                rows, note = collect(args.url, args.targets, args.timeout)
                text = render(rows, args.url, args.json)
            except Unreachable as e:
                note = str(e)
            if args.json:  # JSON lines on stdout, the notes beside them on stderr
                if text is not None:
                    print(text, file=out, flush=True)
                if note is not None:
                    print(f"moebus status: {note}", file=err, flush=True)
            else:
                stamp = f"{time.strftime('%H:%M:%S')}  {args.url}  (every {args.watch:g}s)"
                body = "\n".join(x for x in (stamp, text, note and f"moebus status: {note}") if x)
                print(("\x1b[H\x1b[2J" if clear else "") + body, file=out, flush=True)
            sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_cli_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="every process of a running stack: state, queue, KV, prefix cache, "
                              "latency, restarts", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL, help="the stack's API, as `moebus up` prints it")
    p.add_argument("--targets", default=None, metavar="FILE",
                   help="the stack's Prometheus targets file (`moebus up --log-dir DIR`: DIR/prometheus_targets.json):"
                        " its processes the frontend never heard are listed as missing; without the frontend, "
                        "each process's readiness probe gives its state")
    p.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")
    p.add_argument("--watch", nargs="?", type=_seconds, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (2 when not given) until Ctrl-C")
    p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for the frontend")
    p.set_defaults(func=run)
