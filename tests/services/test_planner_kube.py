"""The Kubernetes actuator's requests, against a local HTTP server playing the API server and
checked with the official client's own models; deploy/planner.yaml's RBAC and arguments."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from moebus.services.planner.config import KubernetesActuatorConfig, PlannerConfig
from moebus.services.planner.fleet import WorkerView
from moebus.services.planner.kube import KubernetesActuator
from moebus.shared.config_cli import add_model_args, model_from_args

k8s = pytest.importorskip("kubernetes.client")
yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


def parse(model: type, body: dict[str, Any]) -> Any:
    """A body as the client itself would read it (pydantic models, or the older generated ones)."""
    if hasattr(model, "from_dict"):
        return model.from_dict(body)

    class Response:
        data = json.dumps(body)

    return k8s.ApiClient().deserialize(Response(), model.__name__)


class FakeApiServer:
    """Deployments' scale subresources: GET answers, PATCH records and applies."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas
        self.requests: list[tuple[str, str, str | None, bytes]] = []  # method, path, content type, body

    def scale(self, ns: str, name: str) -> dict[str, Any]:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": ns},
                "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}}

    async def handle(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = await request.read()
        self.requests.append((request.method, request.path, request.headers.get("Content-Type"), body))
        if name not in self.replicas:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if request.method == "PATCH":
            self.replicas[name] = json.loads(body)["spec"]["replicas"]
        return web.json_response(self.scale(ns, name))


@pytest.fixture
async def api_server():
    fake = FakeApiServer({"worker": 2, "worker-prefill": 1, "worker-decode": 1})
    app = web.Application()
    app.router.add_route("*", SCALE_PATH.format(ns="{ns}", name="{name}"), fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def actuator(url: str, **cfg: Any) -> KubernetesActuator:
    api = k8s.AppsV1Api(k8s.ApiClient(k8s.Configuration(host=url)))
    return KubernetesActuator(KubernetesActuatorConfig(namespace="moebus", **cfg), apps_api=api)


async def test_scale_patches_the_deployment_scale_subresource(api_server) -> None:
    fake, url = api_server
    act = actuator(url)
    workers = [WorkerView("worker-a", "both", True, False, 0)]
    await act.scale("both", 5, workers)
    (m1, p1, _, _), (m2, p2, ctype, body) = fake.requests
    path = SCALE_PATH.format(ns="moebus", name="worker")
    assert (m1, p1) == ("GET", path) and (m2, p2) == ("PATCH", path)
    assert ctype == "application/strategic-merge-patch+json"
    scale = parse(k8s.V1Scale, json.loads(body))
    assert isinstance(scale, k8s.V1Scale) and scale.spec.replicas == 5
    assert fake.replicas["worker"] == 5 and act.stats() == {"patches": [["worker", 5]]}

    fake.requests.clear()  # already there: read only, no patch
    await act.scale("both", 5, workers)
    assert [r[0] for r in fake.requests] == ["GET"]

    await act.scale("decode", 3, workers)  # each pool its own Deployment
    assert fake.requests[-1][:2] == ("PATCH", SCALE_PATH.format(ns="moebus", name="worker-decode"))
    assert fake.replicas == {"worker": 5, "worker-prefill": 1, "worker-decode": 3}
    await act.close()


async def test_a_missing_deployment_is_an_api_error(api_server) -> None:
    _, url = api_server
    act = actuator(url, deployments={"both": "nope"})
    with pytest.raises(k8s.ApiException):
        await act.scale("both", 2, [])
    with pytest.raises(ValueError, match="prefill"):
        await act.scale("prefill", 2, [])


def manifests() -> list[dict[str, Any]]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_planner_manifest_rbac_and_arguments() -> None:
    docs = manifests()
    planner = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "planner")
    pod = planner["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "moebus.services.planner"]
    parser = argparse.ArgumentParser()
    add_model_args(parser, PlannerConfig)
    cfg = model_from_args(PlannerConfig, parser.parse_args([a.replace("$(POD_NAME)", "planner-x")
                                                            for a in container["args"]]))
    assert cfg.actuator == "kubernetes" and cfg.kubernetes.in_cluster
    # every pool it plans maps to a Deployment in deploy/
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert {cfg.kubernetes.deployments[p] for p in cfg.policy.pools} <= names
    # its service account may get and patch deployments/scale, through a Role bound to it
    account = pod["serviceAccountName"]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account for d in docs)
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and
                   any(s["kind"] == "ServiceAccount" and s["name"] == account for s in d["subjects"]))
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"])
    rule = next(r for r in role["rules"] if "deployments/scale" in r["resources"])
    assert rule["apiGroups"] == ["apps"] and {"get", "patch"} <= set(rule["verbs"])
    # nothing else scales the workers: an HPA would fight the planner
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    kustom = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert "planner.yaml" in kustom["resources"] and all((DEPLOY / r).exists() for r in kustom["resources"])
