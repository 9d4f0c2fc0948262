"""Kubernetes actuator: sets `spec.replicas` of each pool's worker Deployment through its scale
subresource (official client; RBAC: get/patch on deployments/scale, deploy/planner.yaml).

Kubernetes picks the pods to remove; each gets SIGTERM and drains (hands its requests over)
within its terminationGracePeriodSeconds. The client is blocking: calls run in a thread.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moebus.shared.messages.planner import PoolName

from .config import KubernetesActuatorConfig
from .fleet import WorkerView

log = logging.getLogger(__name__)
POD_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubernetesActuator:
    name = "kubernetes"

    def __init__(self, cfg: KubernetesActuatorConfig, apps_api: Any = None) -> None:
        """apps_api: a kubernetes.client.AppsV1Api (default: from the in-cluster or kube config)."""
        self.cfg = cfg
        if apps_api is None:
            try:
                from kubernetes import client, config
            except ImportError as e:
                raise RuntimeError("the Kubernetes actuator needs the k8s extra: pip install 'moebus[k8s]'") from e

            config.load_incluster_config() if cfg.in_cluster else config.load_kube_config()
            apps_api = client.AppsV1Api()
        self.api = apps_api
        self.namespace = cfg.namespace or (POD_NAMESPACE.read_text().strip() if cfg.in_cluster and
                                           POD_NAMESPACE.exists() else "default")
        self.patches: list[tuple[str, int]] = []  # (deployment, replicas) sent

    async def scale(self, pool: PoolName, desired: int, workers: Sequence[WorkerView]) -> None:
        name = self.cfg.deployments.get(pool)
        if name is None:
            raise ValueError(f"no Deployment configured for pool {pool!r}")
        await asyncio.to_thread(self._scale, name, desired)

    def _scale(self, name: str, desired: int) -> None:
        ns = self.namespace
        current = self.api.read_namespaced_deployment_scale(name, ns).spec.replicas
        if current == desired:
            return
        log.info("deployment %s/%s: %s -> %d replicas", ns, name, current, desired)
        # A dict body: the client sends a strategic merge patch of just this field.
        self.api.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": desired}})
        self.patches.append((name, desired))

    async def close(self) -> None:
        client = getattr(self.api, "api_client", None)
        if client is not None:
            client.close()

    def stats(self) -> dict[str, Any]:
        return {"patches": [list(p) for p in self.patches]}
