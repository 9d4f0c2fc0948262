"""`moebus up`, `moebus serve <service>`, `moebus keys` and `moebus status`: registered on the main CLI by
add_cli_commands()."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from moebus.platforms.cpu.cores import usable_cores
from moebus.shared.logs import FORMATS, LOG_FORMAT_ENV

from .fleet_shape import SHARED_BURST_STEP_TOKENS, FleetShape, auto_shape, mem_available
from .launcher import SERVICES, up
from .startup import say_to, threads_per_worker
from .worker_memory import estimate

ROLES = ("prefill", "decode")  # `moebus serve decode ...` = `moebus serve worker --role decode ...`


def _json_object(flag: str, text: str) -> dict:
    """A JSON-object flag's value, or exit with one line naming the flag (not a traceback)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"moebus: {flag} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"moebus: {flag} must be a JSON object, not {text!r}")
    return value


def _up(args: argparse.Namespace) -> int:
    worker = _json_object("--worker", args.worker)
    if args.torch_threads:
        worker["torch_threads"] = args.torch_threads
    engine = _json_object("--engine", args.engine)
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    if args.enable_prefix_caching is not None:
        engine["enable_prefix_caching"] = args.enable_prefix_caching
    if args.model != "toy":  # auto: from the CPU's flags, resolved and logged by each worker's engine
        engine.setdefault("dtype", args.dtype)
        engine.setdefault("weight_format", args.weight_format)
    shape = _shape(args, engine, worker)
    if shape.why:
        sharing = " sharing the cores" if shape.share_cores else ""
        say_to(sys.stderr)(f"workers: {shape.workers}{sharing} (--workers auto: {shape.why})")
    made_dir = None
    if shape.share_cores and args.model != "toy":  # every worker may take every core, by turns (platforms/cpu/core_share.py)
        worker.setdefault("torch_threads", usable_cores())
        if "core_share_dir" not in worker:
            worker["core_share_dir"] = made_dir = tempfile.mkdtemp(prefix="moebus-cores-")
        engine.setdefault("burst_step_tokens", SHARED_BURST_STEP_TOKENS)
    if "torch_threads" not in worker and args.model != "toy":  # the cores split between workers, not shared
        each = threads_per_worker(shape.workers if args.mode == "aggregated" else
                                  args.prefill_workers + args.decode_workers)
        if each is not None:
            worker["torch_threads"] = each
    os.environ[LOG_FORMAT_ENV] = args.log_format  # every process the launcher starts inherits it
    try:
        return _run_up(args, shape, engine, worker)
    finally:
        if made_dir is not None:  # the workers' files went with them
            shutil.rmtree(made_dir, ignore_errors=True)


def _run_up(args: argparse.Namespace, shape: FleetShape, engine: dict, worker: dict) -> int:
    if args.api_key:
        print("moebus up: warning: --api-key puts the key on the command line, where `ps` shows it to every "
              "user of this machine; use --api-key-file", file=sys.stderr, flush=True)
    return up(port=args.port, model=args.model, host=args.host, metrics_host=args.metrics_host,
              workers=shape.workers, frontends=args.frontends,
              served_model_name=args.served_model_name, nats_url=args.nats_url, nats_port=args.nats_port,
              nats_cluster=args.nats_cluster,
              api_keys=args.api_key or [], api_keys_file=args.api_key_file,
              heartbeat_interval_s=args.heartbeat_interval,
              max_queued=args.max_queued, engine=engine, log_dir=args.log_dir,
              metrics_targets_file=args.metrics_targets,
              trace_file=args.trace_file, otlp_endpoint=args.otlp_endpoint, trace_sample=args.trace_sample,
              mode=args.mode, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
              kvbroker=False if args.no_kvbroker else None, worker=worker,
              balancer={"policy": args.balancer_policy}, tokenizer=_tokenizer(args), autoscale=args.autoscale, planner=_json_object("--planner", args.planner),
              nats_auth=not args.no_nats_auth, nats_tls_cert=args.nats_tls_cert, nats_tls_key=args.nats_tls_key,
              nats_tls_ca=args.nats_tls_ca, encoders=args.encoders,
              encoder={"encoder": args.image_encoder} if args.image_encoder else {},
              frontend={**_json_object("--frontend", args.frontend), **({"keys_file": args.keys_file} if args.keys_file else {})})


def _tokenizer(args: argparse.Namespace) -> dict:
    if not args.chat_template:
        return {}
    path = Path(args.chat_template).resolve()  # the tokenizer process reads it
    if not path.is_file():
        raise SystemExit(f"moebus up: --chat-template {args.chat_template}: no such file")
    return {"chat_template": str(path)}


def _shape(args: argparse.Namespace, engine: dict, worker: dict) -> FleetShape:
    """The workers to start and whether they share the cores; `why` is set when auto chose."""
    if args.workers != "auto":
        return FleetShape(args.workers, args.share_cores, "")
    if (args.model == "toy" or args.mode != "aggregated" or args.autoscale is not None
            or "torch_threads" in worker):  # a fleet shaped otherwise, or threads the operator chose
        return FleetShape(1, args.share_cores, "")
    from moebus.engine.config import EngineConfig
    from moebus.engine.models import resolve

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    cfg = {k: engine.get(k, defaults[k]) for k in ("dtype", "weight_format", "kv_cache_bytes")}
    worker = estimate(resolve(args.model), str(cfg["dtype"]), str(cfg["weight_format"]), int(cfg["kv_cache_bytes"]))
    return auto_shape(usable_cores(), worker, mem_available())


def workers_arg(text: str) -> int | str:
    """`auto` or a count >= 1."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"need at least 1 worker, got {n}")
    return n


def autoscale_bounds(text: str) -> tuple[int, int]:
    """`MIN:MAX` -> (MIN, MAX), 1 <= MIN <= MAX."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, e.g. 1:4, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _serve(args: argparse.Namespace) -> int:
    service, rest = args.service, list(args.options)
    if service in ROLES:
        service, rest = "worker", ["--role", service, *rest]
    main = importlib.import_module(f"moebus.services.{service}.__main__")
    if args.nats_url:
        rest = ["--nats-url", args.nats_url, *rest]
    main.main(rest)
    return 0


def _bus_files(args: argparse.Namespace) -> int:
    from moebus.shared.bus_hosts import BusHost, BusLayout, bus_files
    from moebus.shared.subjects import Subjects

    try:
        layout = BusLayout([BusHost.parse(h) for h in args.host], Subjects(args.subject_prefix),
                           client_port=args.client_port, route_port=args.route_port, monitor_port=args.monitor_port)
    except ValueError as e:
        raise SystemExit(f"moebus bus-files: {e}") from None
    for name, path in bus_files(layout, args.out).items():
        print(f"{name}: {path}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from .frontend.admission.tenants import KeysFile, add_key, describe
    from .frontend.config import TenantLimits

    if args.action == "list":
        print(describe(KeysFile.load(args.file)))
        return 0
    given = {k: getattr(args, k) for k in ("weight", "priority", "rate", "burst", "max_tokens_in_flight")}
    limits = TenantLimits(**{k: v for k, v in given.items() if v is not None}) if any(
        v is not None for v in given.values()) else None
    print(add_key(args.file, args.tenant, limits, args.label))  # the only time the key is shown
    return 0


def add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    u = subparsers.add_parser("up", help="run nats-server and every service (one process each) on this machine",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    u.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    u.add_argument("--host", default="0.0.0.0", help="address the API listens on (its /metrics too)")
    u.add_argument("--metrics-host", default="127.0.0.1",
                   help="address every other process's /metrics and probes listen on (a free port each, "
                        "listed in --metrics-targets; nats-server listens on 127.0.0.1 only)")
    u.add_argument("--model", default="smollm2", help='engine model ("smollm2", a checkpoint dir, or "toy")')
    u.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    u.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template that replaces the model's (function tools are rendered through it; "
                        "default: the model's own, or for smollm2 the shipped one with tool calling)")
    u.add_argument("--workers", type=workers_arg, default="auto",
                   help="engine worker processes (aggregated mode); the CPU cores are split between them. "
                        "auto: two sharing the cores (--share-cores) where the host has 2+ cores and memory "
                        "for two copies of the model, else one (moebus/services/fleet_shape.py)")
    u.add_argument("--frontends", type=int, default=1, metavar="N",
                   help="frontend processes, the API on --port .. --port+N-1; each enforces 1/N of every "
                        "tenant's rate and token budget (docs/tenants.md)")
    u.add_argument("--share-cores", action="store_true",
                   help="workers share the cores by who has work instead of a fixed split: before each step "
                        "a worker takes the cores // the workers with work (a lone request gets them all); "
                        f"their burst steps are {SHARED_BURST_STEP_TOKENS} tokens unless --engine says")
    u.add_argument("--nats-url", default=None, help="use this NATS instead of starting one")
    u.add_argument("--nats-port", type=int, default=0, help="port of the nats-server we start (0: a free one)")
    u.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                   help="start N nats-server nodes with routes between them (as deploy/nats.yaml); "
                        "every process gets all their URLs and moves to another node when its own goes")
    u.add_argument("--api-key", action="append",
                   help="require this bearer key; repeat for several. `ps` shows it to every user of this "
                        "machine: prefer --api-key-file")
    u.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="require one of these bearer keys (one a line); the frontend gets them by a private "
                        "0600 file, never on a command line or in the environment")
    u.add_argument("--keys-file", default=None, help="API keys -> tenants, with limits (docs/tenants.md)")
    u.add_argument("--frontend", default="{}",
                   help='extra FrontendConfig fields as JSON, e.g. \'{"admission": {"max_running": 32}}\'')
    u.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between each process's heartbeats (a worker silent for 3 is dropped)")
    u.add_argument("--max-queued", type=int, default=128, help="per worker, before answering 429")
    u.add_argument("--engine", default="{}", help='extra EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 8}\'')
    u.add_argument("--log-dir", default=None, help="one <instance>.log per process here (default: this terminal)")
    u.add_argument("--log-format", choices=FORMATS, default="text",
                   help="json: one JSON object per line, with request_id and trace_id (docs/observability.md)")
    u.add_argument("--metrics-targets", default=None, metavar="FILE",
                   help="write the Prometheus file_sd targets (every process's /metrics) here; "
                        "default: LOG_DIR/prometheus_targets.json (docs/observability.md)")
    u.add_argument("--trace-file", default=None, metavar="FILE",
                   help="every process appends its spans here as JSON lines; `moebus trace ID --file FILE` "
                        "shows one request (docs/observability.md)")
    u.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="every process sends its spans to this OTLP/HTTP collector (e.g. http://localhost:4318); "
                        "default: $OTEL_EXPORTER_OTLP_ENDPOINT")
    u.add_argument("--trace-sample", type=float, default=1.0, metavar="RATIO",
                   help="share of new requests traced, 0..1 (a client's traceparent keeps its own decision)")
    u.add_argument("--mode", choices=("aggregated", "disaggregated"), default="aggregated",
                   help="disaggregated: separate prefill and decode pools, KV moved between them")
    u.add_argument("--prefill-workers", type=int, default=1, help="disaggregated mode: prefill workers")
    u.add_argument("--decode-workers", type=int, default=1, help="disaggregated mode: decode workers")
    u.add_argument("--no-kvbroker", action="store_true", help="no KV broker (no KV-aware routing, no shared tiers)")
    u.add_argument("--encoders", type=int, default=None,
                   help="vision encoder processes (default: 1 for a vision-language checkpoint or with "
                        "--image-encoder, else 0: a text-only model, smollm2 included, refuses images; "
                        "--encoders 1 gives smollm2 the ImageNet classifier encoder, docs/vision.md)")
    u.add_argument("--image-encoder", default=None,
                   help="efficientnet-lite0 (the encoder's default), a SmolVLM/Idefics3 checkpoint dir or an "
                        "mmproj .gguf; naming one starts an encoder")
    u.add_argument("--balancer-policy", choices=("kv", "round_robin", "random"), default="kv",
                   help="routing: KV overlap + load (default), or a baseline to compare against")
    u.add_argument("--torch-threads", type=int, default=None,
                   help="torch (OpenMP) threads per worker process (default: the usable cores // the workers)")
    u.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per request, in the engines and the frontend's checks "
                        "(default: the engine's, 8192)")
    u.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="compute dtype of the engines; auto: bfloat16 where the CPU has AVX512-BF16 or AMX, "
                        "else float32 (moebus/platforms/dtype_choice.py)")
    u.add_argument("--weight-format", choices=("auto", "dense", "gguf"), default="auto",
                   help="auto: a GGUF's own quantized blocks on AVX-512 CPUs when dtype is auto (float32 "
                        "activations; the faster lone stream, batches ~20%% slower than bf16), else the "
                        "weights dequantized to the dtype (moebus/platforms/format_choice.py)")
    u.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes seen before (default: on)")
    u.add_argument("--worker", default="{}", help='extra WorkerConfig fields as JSON, e.g. \'{"kv_cpu_bytes": 1e9}\'')
    u.add_argument("--autoscale", type=autoscale_bounds, default=None, metavar="MIN:MAX",
                   help="start MIN workers (each pool, disaggregated) and a planner that keeps every pool "
                        "within MIN..MAX against its SLO, starting and draining workers (docs/planner.md)")
    u.add_argument("--planner", default="{}",
                   help='extra PlannerConfig fields as JSON, e.g. \'{"policy": {"ttft_target_s": 1}}\'')
    u.add_argument("--no-nats-auth", action="store_true",
                   help="an open bus: no NATS users or subject permissions (any local process may use it)")
    u.add_argument("--nats-tls-cert", default=None, help="PEM certificate: the bus speaks TLS (with --nats-tls-key)")
    u.add_argument("--nats-tls-key", default=None, help="the certificate's PEM private key")
    u.add_argument("--nats-tls-ca", default=None, help="PEM CA the services check it against (default: the cert)")
    u.set_defaults(func=_up)

    s = subparsers.add_parser("serve", help="run one service in this process",
                              description="Options after the service name go to it; see "
                                          "`moebus serve <service> --help`.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("service", choices=(*SERVICES, *ROLES, "kvbroker"), help="the service to run")
    s.add_argument("--nats-url", default=None, help="the NATS to join (default: the service's, nats://127.0.0.1:4222)")
    s.add_argument("options", nargs=argparse.REMAINDER, help="the service's own flags (its config fields)")
    s.set_defaults(func=_serve)

    b = subparsers.add_parser("bus-files", help="one bus across hosts: each host's nats.conf and each role's "
                              "bus credentials (docs: deploy/multihost.md)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--out", required=True, help="folder for the files (made 0700; every file 0600: passwords)")
    b.add_argument("--host", action="append", required=True, metavar="NAME=ADDRESS",
                   help="a host of the stack and the address the others reach it at (repeat: one per host)")
    b.add_argument("--client-port", type=int, default=4222, help="each node's client port")
    b.add_argument("--route-port", type=int, default=6222, help="each node's cluster route port")
    b.add_argument("--monitor-port", type=int, default=8222, help="each node's monitoring port (host loopback)")
    b.add_argument("--subject-prefix", default="moebus.v1", help="the services' --subject-prefix")
    b.set_defaults(func=_bus_files)

    k = subparsers.add_parser("keys", help="API keys and tenants in a keys file (docs/tenants.md)")
    k.add_argument("action", choices=("add", "list"), help="add: a new key, printed once (only its hash is "
                   "stored); list: the tenants and their keys' hash prefixes")
    k.add_argument("--file", required=True, help="the keys file (JSON; add creates it)")
    k.add_argument("--tenant", default="default", help="add: the key's tenant")
    k.add_argument("--label", default="", help="add: who holds the key (a note)")
    k.add_argument("--weight", type=float, default=None, help="add: set the tenant's fair share weight")
    k.add_argument("--priority", type=int, default=None, help="add: its engine priority (lower runs first)")
    k.add_argument("--rate", type=float, default=None, help="add: its requests per second")
    k.add_argument("--burst", type=int, default=None, help="add: requests at once above the rate")
    k.add_argument("--max-tokens-in-flight", type=int, default=None, help="add: its token budget")
    k.set_defaults(func=_keys)

    from .status import add_cli_command as add_status

    add_status(subparsers)
