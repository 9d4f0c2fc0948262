"""Start the whole stack on one machine: a real nats-server plus every service as its own process.

`up()` blocks until SIGINT/SIGTERM; `Stack` is the same thing as a context manager (tests use it
to kill a worker process for real); `serve()` runs a single service in this process.
Real models also get a KV broker process (prefix index for KV-aware routing, shared tiers);
`mode="disaggregated"` starts a prefill pool and a decode pool instead of `workers`.
`autoscale=(MIN, MAX)` starts MIN workers per pool plus a planner (local actuator) that keeps every
pool within MIN..MAX: it starts more workers itself and drains them again (docs/planner.md).
The bus is locked (`nats_auth`, shared.bus_auth): every process gets its own NATS user, allowed only
the subjects it needs, by a credentials file named in its environment; this process is the admin.
`nats_cluster=N` starts N nats-server nodes with routes between them (shared.nats_cluster); every
process gets all their URLs and moves to another node when its own goes.
Every child dies with the launcher, even when it is SIGKILLed (shared.lifeline): spawn from a
thread that lives as long as the stack (up() uses its main thread).
Listeners: the API binds `host`; every other process's /metrics and probes bind `metrics_host`
(loopback unless asked), our nats-server loopback. API keys reach the frontend as a 0600 file in
the launcher's private 0700 directory (beside the NATS credentials), never by argv or environment.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moebus.shared.bus import Bus, BusConfig
from moebus.shared.bus_auth import ADMIN, ANY, CREDS_ENV, TLS_CA_ENV, BusUsers, write_credentials
from moebus.shared.config_cli import to_cli_args
from moebus.shared.lifeline import die_with_parent
from moebus.shared.limits import GenerationLimits
from moebus.shared.messages import HealthReply
from moebus.shared.nats_cluster import NatsCluster
from moebus.shared.nats_server import NatsServer
from moebus.shared.ports import free_port
from moebus.shared.service import RESTARTS_ENV, Empty, ServiceConfig, Stats
from moebus.shared.subjects import Subjects
from moebus.shared.trace_export import TraceConfig
from moebus.shared.tracing import Tracing

from .startup import WaitReporter, prepare, say_to, takes_images
from .supervisor import Supervisor

log = logging.getLogger(__name__)
SERVICES = ("tokenizer", "encoder", "balancer", "worker", "frontend", "planner")
# Stopped in reverse: the planner first (no new workers; it stops its own), frontends, the broker last.
STOP_ORDER = ("kvbroker", *SERVICES)


class StartupInterrupted(BaseException):  # as KeyboardInterrupt: no `except Exception` swallows it
    """A signal came (Stack.stopping was set) while the stack was starting."""


class StackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = 8000
    host: str = "0.0.0.0"  # the API's address (the frontend's /metrics is on its port)
    metrics_host: str = "127.0.0.1"  # the /metrics + probes address of every other process
    model: str = "smollm2"
    served_model_name: str | None = None  # default: the model argument
    workers: int = Field(1, ge=1)
    # Frontend processes: frontend-i serves the API on port + i; each enforces 1/N of every tenant's
    # rate and token budget, N counted from their heartbeats (frontend/fleet/peers.py, docs/tenants.md).
    frontends: int = Field(1, ge=1)
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    prefill_workers: int = Field(1, ge=1)  # disaggregated mode: the two pools
    decode_workers: int = Field(1, ge=1)
    kvbroker: bool | None = None  # None: on for real models (the toy engine has no KV cache)
    # Vision encoders; None: 1 where the model takes images (a VLM checkpoint) or `encoder` names an
    # image encoder, else 0 (a text-only model: images are refused).
    encoders: int | None = Field(None, ge=0)
    encoder: dict[str, Any] = {}  # extra EncoderConfig fields (e.g. {"encoder": "<SmolVLM dir>"})
    kvbroker_args: list[str] = []  # extra KVBrokerConfig flags, e.g. ["--cpu-bytes", "1G"]
    worker: dict[str, Any] = {}  # extra WorkerConfig fields for every worker (e.g. torch_threads)
    balancer: dict[str, Any] = {}  # extra BalancerConfig fields
    tokenizer: dict[str, Any] = {}  # extra TokenizerConfig fields (e.g. {"chat_template": "<jinja file>"})
    nats_url: str | None = None  # use a running NATS instead of starting one
    nats_port: int = 0  # 0: a free port (node 0's, in a cluster)
    nats_cluster: int = Field(1, ge=1)  # nats-server nodes we start (routes between them when > 1)
    nats_monitor: bool = False  # their HTTP monitoring (/connz: who is connected where), on free ports
    # Flat API keys (the `default` tenant), and a file of more, one a line. The frontend gets them
    # all by a file of ours; $MOEBUS_API_KEYS (deprecated) is read here and kept from the children.
    api_keys: list[str] = []
    api_keys_file: str | None = None
    heartbeat_interval_s: float = 1.0
    max_queued: int = 128
    engine: dict[str, Any] = {}  # extra EngineConfig fields for every worker
    frontend: dict[str, Any] = {}  # extra FrontendConfig fields
    log_dir: str | None = None  # one <instance>.log per process; default: inherit stderr
    # Every process serves /metrics (a free port each; the frontend: on its API port), listed in a
    # Prometheus file_sd targets file (default: <log_dir>/prometheus_targets.json; docs/observability.md).
    metrics: bool = True
    metrics_targets_file: str | None = None
    # Spans of every process (shared/trace_export.py): appended to this JSONL file (`moebus trace`
    # reads it) and/or sent to this OTLP/HTTP collector; the share of new requests traced.
    trace_file: str | None = None
    otlp_endpoint: str | None = None
    trace_sample: float = Field(1.0, ge=0.0, le=1.0)
    ready_timeout_s: float = 600.0
    # (MIN, MAX): MIN workers per pool at start, a planner process scales each pool within MIN..MAX.
    autoscale: tuple[int, int] | None = None
    planner: dict[str, Any] = {}  # extra PlannerConfig fields, merged over the launcher's (e.g. {"policy": {...}})
    # The NATS we start: a user per process with only its subjects (off: anyone local may do anything);
    # TLS with this certificate and key (PEM), checked by clients against nats_tls_ca (default: the cert).
    nats_auth: bool = True
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    nats_tls_ca: str | None = None

    @model_validator(mode="after")
    def _autoscale_bounds(self) -> Self:
        if self.autoscale is not None and not 1 <= self.autoscale[0] <= self.autoscale[1]:
            raise ValueError(f"autoscale MIN:MAX needs 1 <= MIN <= MAX, got {self.autoscale}")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ValueError("TLS needs both nats_tls_cert and nats_tls_key")
        return self


def _reachable(host: str) -> str:
    """An address to reach a listener bound to `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _config_classes() -> dict[str, type[ServiceConfig]]:
    from .balancer.config import BalancerConfig
    from .encoder.config import EncoderConfig
    from .frontend.config import FrontendConfig
    from .kvbroker.config import KVBrokerConfig
    from .planner.config import PlannerConfig
    from .tokenizer.config import TokenizerConfig
    from .worker.config import WorkerConfig

    return {"tokenizer": TokenizerConfig, "encoder": EncoderConfig, "balancer": BalancerConfig, "worker": WorkerConfig,
            "frontend": FrontendConfig, "kvbroker": KVBrokerConfig, "planner": PlannerConfig}


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, nested dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Stack:
    on_wait: Callable[[list[str]], None] | None = None  # told, while waiting for ready, who is still starting
    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.bus_nodes: NatsCluster | None = None  # the NATS we started (one node, or a cluster)
        self.stopping = threading.Event()  # set (by a signal): start-up gives up at the next step
        self.procs: dict[str, subprocess.Popen] = {}  # instance id -> process
        self.services: dict[str, str] = {}  # instance id -> service name
        self._launches: dict[str, tuple[str, list[str], dict[str, str] | None]] = {}  # how each was started
        self.nats_url = cfg.nats_url or ""  # for clients in this process: the admin's credentials in it
        self.services_url = cfg.nats_url or ""  # what services are given (their credentials: by file)
        self.users: BusUsers | None = None  # our NATS's users when auth is on
        self._private: tempfile.TemporaryDirectory | None = None  # 0700: NATS credentials, the API keys
        self._api_keys_file: Path | None = None  # the frontend's keys, in _private
        self.metrics_ports: dict[str, tuple[str, int]] = {}  # instance id -> (service, its /metrics port)
        self.restarts: dict[str, int] = {}  # instance id -> times respawn() started it again

    @property
    def nats(self) -> NatsServer | None:
        """Our (first) nats-server; None when the stack uses a NATS it did not start."""
        return self.bus_nodes.nodes[0] if self.bus_nodes is not None and self.bus_nodes.nodes else None

    @property
    def nats_procs(self) -> dict[str, NatsServer]:
        """Our nats-server nodes by name (the supervisor restarts them too)."""
        return {} if self.bus_nodes is None else {f"nats-{i}": n for i, n in enumerate(self.bus_nodes.nodes)}

    @property
    def url(self) -> str:
        """frontend-0's API."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every frontend's API, frontend-0's first."""
        return [f"http://{_reachable(self.cfg.host)}:{self.cfg.port + i}" for i in range(self.cfg.frontends)]

    def service_configs(self) -> list[tuple[str, ServiceConfig]]:
        c, classes = self.cfg, _config_classes()
        name = c.served_model_name or c.model
        common = {"nats_url": self.services_url, "heartbeat_interval_s": c.heartbeat_interval_s}
        # The frontend's request bounds, its context as the engines'; the balancer and the workers
        # check the generation ones again (shared/limits.py) with the same values.
        flimits = dict(c.frontend.get("limits", {}))
        if "max_model_len" in c.engine:
            flimits = {"max_model_len": c.engine["max_model_len"], **flimits}
        limits = {k: v for k, v in flimits.items() if k in GenerationLimits.model_fields}
        out: list[tuple[str, ServiceConfig]] = [
            ("tokenizer", classes["tokenizer"](instance_id="tokenizer-0", model=c.model, served_model_name=name,
                                               **c.tokenizer, **common)),
            ("balancer", classes["balancer"](instance_id="balancer-0", **{"mode": c.mode, "limits": limits,
                                                                          **c.balancer}, **common)),
        ]
        for i in range(self.num_encoders):
            out.append(("encoder", classes["encoder"](instance_id=f"encoder-{i}", model=c.model, served_model_name=name,
                                                      **c.encoder, **common)))
        pools = [("worker", "both", c.workers)] if c.mode == "aggregated" else [
            ("prefill", "prefill", c.prefill_workers), ("decode", "decode", c.decode_workers)]
        if c.autoscale is not None:  # every pool starts at MIN
            pools = [(prefix, role, c.autoscale[0]) for prefix, role, _ in pools]
        template = {"model": c.model, "served_model_name": name, "max_queued": c.max_queued, "engine": c.engine,
                    "limits": limits, **c.worker}
        for prefix, role, n in pools:
            for i in range(n):
                wcfg = {"role": role, **template}
                out.append(("worker", classes["worker"](instance_id=f"{prefix}-{i}", **wcfg, **common)))
        # the frontend renders prompts with its own copy of the tokenizer service's tokenizer (no bus round trip)
        local = {"model": c.model, "served_model_name": name, "chat_template": c.tokenizer.get("chat_template")}
        keys = {"api_keys_file": str(self._api_keys_file)} if self._api_keys_file else {}
        fcfg = {"accept_images": self.num_encoders > 0, "local_render": local, **keys, **c.frontend, "limits": flimits}
        from moebus.text.tool_parser_deepseek import parser_for  # no deepseek_recipe import: config.json only

        if (parser := parser_for(c.model)) is not None:  # DeepSeek-V4: its own reasoning and call format
            fcfg["tool_call_parsers"] = {name: parser, **fcfg.get("tool_call_parsers", {})}
        for i in range(c.frontends):
            out.append(("frontend", classes["frontend"](instance_id=f"frontend-{i}", host=c.host, port=c.port + i,
                                                        models=[name], **fcfg, **common)))
        if c.autoscale is not None:
            lo, hi = c.autoscale
            planner = {"actuator": "local",
                       # its workers are like ours; it stops them on shutdown before stop() gives up on it
                       "local": {"worker": template, "log_dir": c.log_dir, "stop_timeout_s": 15.0},
                       "policy": {"pools": {role: {"min_replicas": lo, "max_replicas": hi} for _, role, _ in pools}}}
            out.append(("planner", classes["planner"](instance_id="planner-0", **_merged(planner, c.planner),
                                                      **common)))
        return out

    def start(self) -> Self:
        if self.cfg.log_dir:
            Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        self._write_api_keys()  # first: it takes $MOEBUS_API_KEYS out of what every child inherits
        if not self.cfg.nats_url:
            self._start_nats()
        env = dict(os.environ)
        if self.cfg.trace_file or self.cfg.otlp_endpoint:  # every process exports its spans (trace_export.py)
            env.update(TraceConfig(self.cfg.trace_file, self.cfg.otlp_endpoint, self.cfg.trace_sample).to_env())
        if self.kvbroker_on:
            self._check_stopping()
            self.spawn_kvbroker(env)
        for service, scfg in self.service_configs():
            self._check_stopping()
            self.spawn(service, scfg, env)
        self.write_metrics_targets()
        return self

    def _private_dir(self) -> Path:
        """This stack's own directory (0700, removed on stop): secrets its children read by path."""
        if self._private is None:
            self._private = tempfile.TemporaryDirectory(prefix="moebus-")
        return Path(self._private.name)

    def _write_api_keys(self) -> None:
        """Every flat key (config, its file, the deprecated environment) into one 0600 file for the
        frontend. $MOEBUS_API_KEYS leaves this process's environment, so no child inherits it."""
        from .frontend.admission.tenants import API_KEYS_ENV, env_api_keys, read_api_keys, write_api_keys

        c = self.cfg
        keys = [*c.api_keys, *(read_api_keys(c.api_keys_file) if c.api_keys_file else []), *env_api_keys()]
        os.environ.pop(API_KEYS_ENV, None)
        if (keys or c.api_keys_file) and self._api_keys_file is None:  # a keys file with no keys: nobody gets in
            self._api_keys_file = write_api_keys(self._private_dir() / "api_keys", keys)

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise StartupInterrupted("stopped during start-up")

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Prometheus file_sd entries, one per process serving /metrics."""
        hosts = {"frontend": _reachable(self.cfg.host)}
        return [{"targets": [f"{hosts.get(service, _reachable(self.cfg.metrics_host))}:{port}"],
                 "labels": {"service": service, "instance_id": i}}
                for i, (service, port) in sorted(self.metrics_ports.items())]

    def write_metrics_targets(self) -> str | None:
        c = self.cfg
        path = c.metrics_targets_file or (str(Path(c.log_dir) / "prometheus_targets.json") if c.log_dir else None)
        if path is not None:
            Path(path).write_text(json.dumps(self.metrics_targets(), indent=1) + "\n")
        return path

    @property
    def num_encoders(self) -> int:
        c = self.cfg
        return c.encoders if c.encoders is not None else int("encoder" in c.encoder or takes_images(c.model))

    def _start_nats(self) -> None:
        c = self.cfg
        admin = None
        if c.nats_auth:
            self.users = BusUsers()
            admin = self.users.add(ADMIN)
            for service, scfg in self.service_configs():  # users of every process up front: no reload races
                self._credentials_file(service, scfg.instance_id)
            if self.kvbroker_on:
                self._credentials_file("kvbroker", "kvbroker-0")
        self.bus_nodes = NatsCluster(
            c.nats_cluster, log_dir=c.log_dir, ports=[c.nats_port] + [0] * (c.nats_cluster - 1),
            tls_cert=c.nats_tls_cert, tls_key=c.nats_tls_key, die_with_parent=True, monitor=c.nats_monitor,
            authorization=self.users.authorization() if self.users else None).start()
        self.services_url = self.nats_url = self.bus_nodes.url
        if admin is not None:
            self.nats_url = ",".join(url.replace("://", f"://{admin.user}:{admin.password}@", 1)
                                     for url in self.bus_nodes.urls)

    def _credentials_file(self, service: str, instance_id: str) -> Path:
        """The credentials file of one process (made with its user on first use); a planner's also
        holds the user of the workers it starts (any id: they take its "*" entry)."""
        assert self.users is not None
        path = self._private_dir() / f"{instance_id}.json"
        if not path.exists():
            entries = {instance_id: self.users.add(service, instance_id)}
            if service == "planner":
                entries[ANY] = self.users.add("worker")
            write_credentials(path, entries)
            if self.bus_nodes is not None:  # a process the server has no user for yet
                self.bus_nodes.reload(self.users.authorization())
        return path

    def bus_config(self, name: str) -> BusConfig:
        """A client of this stack in this process (the admin user when auth is on)."""
        servers = [u.strip() for u in self.nats_url.split(",") if u.strip()]
        if self.nats is None:  # not ours: credentials as the environment has them
            return BusConfig(servers=servers, name=name)
        tls_ca = self.cfg.nats_tls_ca or self.cfg.nats_tls_cert
        return BusConfig(servers=servers, name=name, credentials=None, tls_ca=tls_ca)

    @property
    def kvbroker_on(self) -> bool:
        return self.cfg.kvbroker if self.cfg.kvbroker is not None else self.cfg.model != "toy"

    def spawn_kvbroker(self, env: dict[str, str] | None = None, instance_id: str = "kvbroker-0") -> subprocess.Popen:
        scfg = _config_classes()["kvbroker"](instance_id=instance_id, nats_url=self.services_url,
                                             heartbeat_interval_s=self.cfg.heartbeat_interval_s)
        return self.spawn("kvbroker", scfg, env, self.cfg.kvbroker_args)

    def spawn(self, service: str, scfg: ServiceConfig, env: dict[str, str] | None = None,
              extra_args: Sequence[str] = ()) -> subprocess.Popen:
        """extra_args: flags after the config's own (the last of a repeated flag wins)."""
        if self.cfg.metrics and service != "frontend" and scfg.http_port is None:
            scfg = scfg.model_copy(update={"http_port": free_port(), "http_host": self.cfg.metrics_host})
        port = scfg.port if service == "frontend" else scfg.http_port
        if port is not None:
            self.metrics_ports[scfg.instance_id] = (service, port)
        cmd = [sys.executable, "-m", f"moebus.services.{service}", *to_cli_args(scfg), *extra_args]
        return self._popen(scfg.instance_id, service, cmd, env)

    def _popen(self, instance_id: str, service: str, cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        env = dict(os.environ if env is None else env)
        env.pop(RESTARTS_ENV, None)  # its own count, never one this launcher inherited
        if restarts := self.restarts.get(instance_id, 0):
            env[RESTARTS_ENV] = str(restarts)  # in its heartbeats (`moebus status`)
        if self.nats is not None:  # its credentials by file, its TLS trust by path: never on the command line
            if self.users is not None:
                if any(p in arg for arg in cmd for p in self.users.passwords()):
                    raise ValueError(f"a NATS password would be on the command line of {instance_id}")
                env[CREDS_ENV] = str(self._credentials_file(service, instance_id))
            if self.cfg.nats_tls_cert:
                env[TLS_CA_ENV] = self.cfg.nats_tls_ca or self.cfg.nats_tls_cert
        out = None
        if self.cfg.log_dir:
            out = open(Path(self.cfg.log_dir) / f"{instance_id}.log", "ab")  # noqa: SIM115
        # Own session: Ctrl-C reaches only the launcher, which then stops everyone in order; killed
        # when the launcher is killed (no orphans; why SIGKILL: shared/lifeline.py).
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL))
        self.procs[instance_id], self.services[instance_id] = proc, service
        self._launches[instance_id] = (service, cmd, env)
        return proc

    def respawn(self, instance_id: str) -> None:
        """Start an exited process again: same id, same command line (the supervisor's restart);
        a nats-server node: same port, routes, users and TLS."""
        if instance_id in self.nats_procs:
            assert self.bus_nodes is not None
            self.bus_nodes.restart(int(instance_id.removeprefix("nats-")))
            return
        self.restarts[instance_id] = self.restarts.get(instance_id, 0) + 1
        service, cmd, env = self._launches[instance_id]
        self._popen(instance_id, service, cmd, env)

    def forget(self, instance_id: str) -> None:
        """A process that is gone for good (a drained worker)."""
        del self.procs[instance_id], self.services[instance_id]
        self.metrics_ports.pop(instance_id, None)

    def wait_ready(self, timeout: float | None = None) -> None:
        coro = self.wait_ready_async(timeout)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code: no nested loops
            pool.submit(asyncio.run, coro).result()

    async def wait_ready_async(self, timeout: float | None = None) -> None:
        """Until every instance answers `ready` and each balancer sees every worker."""
        timeout = timeout or self.cfg.ready_timeout_s
        bus = await Bus.connect(self.bus_config("launcher"), Tracing("launcher"))
        subjects, pending = Subjects(), dict(self.services)
        deadline = time.monotonic() + timeout
        try:
            while pending:
                self._check_stopping()
                for instance, service in list(pending.items()):
                    code = self.procs[instance].poll()
                    if code is not None:
                        raise RuntimeError(f"{instance} exited with code {code} before it was ready")
                    try:
                        await bus.request(subjects.ready(service, instance), Empty(), HealthReply, timeout=0.5)
                        del pending[instance]
                    except Exception:  # not up yet (no responders, timeout, error reply)
                        pass
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"not ready after {timeout:g}s: {sorted(pending)}")
                if pending:
                    if self.on_wait is not None:
                        self.on_wait(list(pending))
                    await asyncio.sleep(0.2)
            await self._until_balancers_see_workers(bus, deadline)
            await self._until_frontend_ready(deadline)
        finally:
            await bus.drain()

    async def _until_frontend_ready(self, deadline: float) -> None:
        """Until each frontend's GET /ready is 200: it has heard every served model's warmed-up worker."""
        import aiohttp

        if "frontend" not in self.services.values():
            return
        async with aiohttp.ClientSession() as http:
            for url in self.urls:
                while True:
                    try:
                        async with http.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                            if r.status == 200:
                                break
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the frontend's /ready at {url} is not 200")
                    await asyncio.sleep(0.1)

    async def _until_balancers_see_workers(self, bus: Bus, deadline: float) -> None:
        workers = {i for i, s in self.services.items() if s == "worker"}
        for balancer in (i for i, s in self.services.items() if s == "balancer"):
            while True:
                self._check_stopping()
                stats = await bus.request(Subjects().stats("balancer", balancer), Empty(), Stats, timeout=2)
                if workers <= {w["worker_id"] for w in stats.stats["workers"] if w["ready"]}:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{balancer} does not see every worker")
                await asyncio.sleep(0.05)

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        self.procs[instance_id].send_signal(sig)

    def restart_nats(self, down_s: float) -> None:
        """A bus blip for every process: stop our nats-server, wait down_s, start it again on the
        same port with the same users and TLS (RELIABILITY.md, tests)."""
        if self.bus_nodes is None:
            raise RuntimeError("this stack did not start its NATS")
        for node in self.bus_nodes.nodes:
            node.stop()
        time.sleep(down_s)
        for i in range(len(self.bus_nodes.nodes)):
            self.bus_nodes.restart(i)

    def stop(self, timeout: float = 20.0) -> None:
        # Frontends first (no new work), then the rest; each drains on SIGTERM.
        order = sorted(self.procs, key=lambda i: STOP_ORDER.index(self.services[i]), reverse=True)
        for instance in order:
            if self.procs[instance].poll() is None:
                self.procs[instance].terminate()
        deadline = time.monotonic() + timeout
        for instance in order:
            proc = self.procs[instance]
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.bus_nodes is not None:
            self.bus_nodes.stop()
        if self._private is not None:
            self._private.cleanup()
            self._private, self._api_keys_file = None, None

    def __enter__(self) -> Self:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def up(port: int = 8000, model: str = "smollm2", **opts: Any) -> int:
    """Run the stack until SIGINT/SIGTERM, which may come at any moment (during start-up too: it
    stops what started and returns 0); a process that crashes (nats-server included) is restarted
    (supervisor.py), one that keeps crashing stops the stack."""
    cfg = StackConfig(port=port, model=model, **opts)
    stack = Stack(cfg)
    stop, preparing = stack.stopping, threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()  # start() and wait_ready() look at it every step
        if preparing.is_set():  # a conversion or a kernel build: interrupted where it is (both clean up)
            preparing.clear()
            raise StartupInterrupted("stopped during start-up")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            say = say_to()
            preparing.set()
            # [1/4] model conversion, [2/4] kernel builds: once, here, not in every worker
            summary = prepare(model, say, cfg.engine)
            if summary is not None and "max_model_len" not in cfg.engine:
                cfg.engine["max_model_len"] = summary.context  # the frontend checks what the engines allow
            preparing.clear()
            say(f"[3/4] starting {len(stack.service_configs())} processes")
            stack.on_wait = WaitReporter(say)  # [4/4] warm-up: who is still loading or warming up
            stack.start()
            stack.wait_ready()
        except StartupInterrupted:
            print("moebus: stopped during start-up", file=sys.stderr, flush=True)
            return 0
        pools = f"{cfg.workers} worker(s)" if cfg.mode == "aggregated" else \
            f"{cfg.prefill_workers} prefill + {cfg.decode_workers} decode worker(s)"
        if cfg.autoscale is not None:
            each = "" if cfg.mode == "aggregated" else " per pool (prefill, decode)"
            pools = f"{cfg.autoscale[0]}..{cfg.autoscale[1]} worker(s){each} scaled by planner-0"
        served = cfg.served_model_name or model
        apis = ", ".join(f"{u}/v1" for u in stack.urls)
        print(f"moebus up: {apis} (model {served}{'' if summary is None else f': {summary}'}, {pools}, "
              f"{'KV broker, ' if stack.kvbroker_on else ''}"
              f"{f'{stack.num_encoders} image encoder(s), ' if stack.num_encoders else ''}NATS {stack.services_url}"
              f"{'' if stack.users is None else ', bus auth on'})", flush=True)
        if (targets := stack.write_metrics_targets()) is not None:
            print(f"moebus up: Prometheus targets (file_sd) in {targets}", flush=True)
        supervisor = Supervisor(stack)  # restarts what crashes; drained workers stay down
        while not stop.wait(0.5):
            if (reason := supervisor.check()) is not None:
                print(f"moebus: {reason}; shutting down", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        stack.stop()
        for s, h in previous.items():
            signal.signal(s, h)


def serve(service: str, nats_url: str, **opts: Any) -> None:
    """Run one service in this process until SIGINT/SIGTERM."""
    if service not in STOP_ORDER:
        raise ValueError(f"unknown service {service!r}; one of {STOP_ORDER}")
    cfg = _config_classes()[service](nats_url=nats_url, **opts)
    main = importlib.import_module(f"moebus.services.{service}.__main__")
    main.main(to_cli_args(cfg))
