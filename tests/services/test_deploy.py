"""The Kubernetes manifests agree with the code: every service's args parse into its config, probes
hit the endpoints it serves (on the pod's address), API keys come as a file, the worker pods
outlive their drain (the planner's manifest and RBAC:
test_planner_kube.py)."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from moebus.shared.config_cli import add_model_args, model_from_args

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = {"frontend": "FrontendConfig", "tokenizer": "TokenizerConfig", "worker": "WorkerConfig",
           "balancer": "BalancerConfig", "planner": "PlannerConfig", "encoder": "EncoderConfig"}


def docs() -> list[dict]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def deployments() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Deployment"}


def test_one_deployment_per_service_and_a_nats_statefulset() -> None:
    assert set(deployments()) == set(CONFIGS)
    nats = [d for d in docs() if d["kind"] == "StatefulSet"]
    assert len(nats) == 1 and nats[0]["spec"]["replicas"] >= 3
    conf = next(d for d in docs() if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert "jetstream" in conf and "cluster" in conf


@pytest.mark.parametrize("service", sorted(CONFIGS))
def test_args_parse_and_probes_match(service: str) -> None:
    container = deployments()[service]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", f"moebus.services.{service}"]
    cls = getattr(importlib.import_module(f"moebus.services.{service}.config"), CONFIGS[service])
    parser = argparse.ArgumentParser()
    add_model_args(parser, cls)
    args = [a.replace("$(POD_NAME)", f"{service}-7d9f-abcde") for a in container["args"]]
    cfg = model_from_args(cls, parser.parse_args(args))
    assert cfg.nats_url == "nats://nats:4222" and cfg.instance_id.startswith(service)
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    paths = {p: container[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")}
    if service == "frontend":  # liveness stays cheap; readiness waits for a warmed-up worker per model
        assert cfg.port == port and paths == {"readinessProbe": "/ready", "livenessProbe": "/health"}
    else:  # the probe server binds loopback unless told: the kubelet probes the pod's IP
        assert cfg.http_port == port and set(paths.values()) == {"/healthz", "/readyz"}
        assert cfg.http_host == "0.0.0.0"


def test_api_keys_reach_the_frontend_as_a_file() -> None:
    """Never in the environment (readable in /proc): the Secret mounted, its path in the args."""
    spec = deployments()["frontend"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert not [e for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    path = container["args"][container["args"].index("--api-keys-file") + 1]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secret = next(v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "api-keys")
    assert path.startswith(mounts["api-keys"] + "/")
    keys = next(d for d in docs() if d["kind"] == "Secret" and d["metadata"]["name"] == secret)
    assert path.rsplit("/", 1)[1] in keys["stringData"]


def test_worker_grace_period() -> None:
    worker = deployments()["worker"]["spec"]["template"]["spec"]
    args = worker["containers"][0]["args"]
    grace = float(args[args.index("--drain-grace-s") + 1])
    assert worker["terminationGracePeriodSeconds"] > grace, "the pod must outlive the worker's drain"
