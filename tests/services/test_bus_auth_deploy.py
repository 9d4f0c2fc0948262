"""Bus auth in deploy/: NATS includes the users from the `nats-auth` Secret, every service pod gets
its role's credentials Secret, and `python -m moebus.shared.bus_auth` makes Secrets that agree."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebus.shared.bus_auth import CREDS_ENV, ROLES, SERVICE_ROLES, permissions
from moebus.shared.nats_server import find_nats_server
from moebus.shared.subjects import Subjects

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def docs() -> list[dict]:
    return [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def secrets() -> dict[str, dict[str, str]]:
    out = subprocess.run([sys.executable, "-m", "moebus.shared.bus_auth"], capture_output=True, text=True, check=True)
    return {s["metadata"]["name"]: s["stringData"] for s in json.loads(out.stdout)["items"]}


@pytest.mark.parametrize("name", ["frontend", "tokenizer", "balancer", "worker", "planner"])
def test_every_service_pod_mounts_its_roles_credentials(name: str) -> None:
    deployment = next(d for d in docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    creds = Path(next(e["value"] for e in container["env"] if e["name"] == CREDS_ENV))
    mount = next(m for m in container["volumeMounts"] if creds.parent == Path(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert name in SERVICE_ROLES and volume["secret"]["secretName"] == f"moebus-bus-{name}"
    assert "--nats-url" in container["args"] and not any("password" in a for a in container["args"])


def test_nats_includes_the_generated_users_and_accepts_them(tmp_path: Path) -> None:
    nats = next(d for d in docs() if d["kind"] == "StatefulSet")
    conf = next(d for d in docs() if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    include = re.search(r"^\s*include\s+(\S+)", conf, re.M).group(1)
    sources = next(v for v in nats["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")["projected"]
    assert {"secret": {"name": "nats-auth"}} in sources["sources"]
    made = secrets()
    (tmp_path / "nats.conf").write_text(conf)
    (tmp_path / include).write_text(made["nats-auth"][include])
    out = subprocess.run([find_nats_server(), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True,
                         text=True, env={**os.environ, "POD_NAME": "nats-0"})
    assert out.returncode == 0, out.stderr


def test_generated_credentials_match_the_server_users() -> None:
    made = secrets()
    auth = made["nats-auth"]["auth.conf"]
    users = {u["user"]: u for u in json.loads(auth.removeprefix("authorization:").strip())["users"]}
    assert set(users) == set(ROLES)
    for role in ROLES:
        creds = json.loads(made[f"moebus-bus-{role}"]["creds.json"])["*"]
        user = users[creds["user"]]
        assert user["password"] == creds["password"]
        assert user["permissions"] == permissions(role, Subjects(), user=creds["user"]).to_nats()
    assert len({u["password"] for u in users.values()}) == len(ROLES)
    assert secrets()["nats-auth"] != made["nats-auth"], "each run makes fresh passwords"
