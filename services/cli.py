"""`moebus up` and `moebus serve <service>`: registered on the main CLI by add_cli_commands()."""
from __future__ import annotations

import argparse
import importlib
import json

from .launcher import SERVICES, up


def _up(args: argparse.Namespace) -> int:
    return up(port=args.port, model=args.model, host=args.host, workers=args.workers,
              served_model_name=args.served_model_name, nats_url=args.nats_url, nats_port=args.nats_port,
              api_keys=args.api_key or [], heartbeat_interval_s=args.heartbeat_interval,
              max_queued=args.max_queued, engine=json.loads(args.engine), log_dir=args.log_dir)


def _serve(args: argparse.Namespace) -> int:
    main = importlib.import_module(f"moebus.services.{args.service}.__main__")
    rest = list(args.options)
    if args.nats_url:
        rest = ["--nats-url", args.nats_url, *rest]
    main.main(rest)
    return 0


def add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    u = subparsers.add_parser("up", help="run nats-server and every service (one process each) on this machine")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--host", default="0.0.0.0")
    u.add_argument("--model", default="smollm2", help='engine model ("smollm2", a checkpoint dir, or "toy")')
    u.add_argument("--served-model-name", default=None)
    u.add_argument("--workers", type=int, default=1)
    u.add_argument("--nats-url", default=None, help="use this NATS instead of starting one")
    u.add_argument("--nats-port", type=int, default=0)
    u.add_argument("--api-key", action="append", help="require this bearer key; repeat for several")
    u.add_argument("--heartbeat-interval", type=float, default=1.0)
    u.add_argument("--max-queued", type=int, default=128, help="per worker, before answering 429")
    u.add_argument("--engine", default="{}", help='extra EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 8}\'')
    u.add_argument("--log-dir", default=None)
    u.set_defaults(func=_up)

    s = subparsers.add_parser("serve", help="run one service in this process",
                              description="Options after the service name go to it; see "
                                          "`python -m moebus.services.<service> --help`.")
    s.add_argument("service", choices=SERVICES)
    s.add_argument("--nats-url", default=None)
    s.add_argument("options", nargs=argparse.REMAINDER)
    s.set_defaults(func=_serve)
