"""What `moebus up` starts is what deploy/nats.yaml runs (issue #23 items 3 and 5): the same
max_payload (read by a real nats-server from the manifest's own value: "8MB" is in its units), the
same cluster name, a full mesh of routes over the StatefulSet's replicas, and routes closed to
anyone but the NATS pods (locally: a route user)."""
from __future__ import annotations

import re
from pathlib import Path

import nats
import pytest

from moebus.shared.nats_cluster import CLUSTER_NAME, NatsCluster
from moebus.shared.nats_server import DEFAULT_MAX_PAYLOAD, NatsServer

yaml = pytest.importorskip("yaml")
MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "nats.yaml"


def manifest() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def nats_conf() -> str:
    return next(d for d in manifest() if d["kind"] == "ConfigMap")["data"]["nats.conf"]


def setting(conf: str, key: str) -> str:
    [value] = re.findall(rf"^\s*{key}:\s*(\S+)", conf, re.M)
    return value


async def test_the_manifests_max_payload_is_the_launchers(tmp_path) -> None:
    """A real nats-server reads the manifest's max_payload; clients of it and of our NatsServer are
    told the same limit, DEFAULT_MAX_PAYLOAD (the bus refuses anything larger before publishing)."""
    conf = tmp_path / "nats.conf"
    conf.write_text(f"max_payload: {setting(nats_conf(), 'max_payload')}\n")
    deployed = NatsServer(jetstream=False)
    deployed.config = lambda: conf.read_text()  # only the manifest's line
    for server in (deployed, NatsServer(jetstream=False)):
        with server:
            nc = await nats.connect(server.url)
            try:
                assert nc.max_payload == DEFAULT_MAX_PAYLOAD
            finally:
                await nc.close()


def test_the_cluster_is_the_local_ones() -> None:
    conf = nats_conf()
    [statefulset] = [d for d in manifest() if d["kind"] == "StatefulSet"]
    replicas = statefulset["spec"]["replicas"]
    assert replicas == 3 == NatsCluster().size
    cluster = conf[conf.index("cluster {"):]
    assert setting(cluster, "name") == CLUSTER_NAME
    routes = re.findall(r"nats://nats-(\d+)\.nats-headless:(\d+)", cluster)
    assert sorted(int(i) for i, _ in routes) == list(range(replicas))  # a route to every replica
    assert {int(p) for _, p in routes} == {int(setting(cluster, "port"))}
    [policy] = [d for d in manifest() if d["kind"] == "NetworkPolicy"]
    route_rule = next(r for r in policy["spec"]["ingress"] if {"port": 6222} in r["ports"])
    assert route_rule["from"] == [{"podSelector": {"matchLabels": statefulset["spec"]["selector"]["matchLabels"]}}]
