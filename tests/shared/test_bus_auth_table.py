"""The bus permission table (shared.bus_auth) covers every subject and keeps the issue's rules;
credentials files and the server config it renders (checked by nats-server itself)."""
from __future__ import annotations

import inspect
import json
import stat
import subprocess

import pytest

from moebus.shared.bus_auth import (
    ADMIN,
    ANY,
    SERVICE_ROLES,
    BusUsers,
    Credentials,
    load_credentials,
    operator_subjects,
    permissions,
    subject_matches,
    write_credentials,
)
from moebus.shared.nats_server import NatsServer, find_nats_server
from moebus.shared.subjects import Subjects

S = Subjects("t1.moebus.v1")
SAMPLES = {"service": SERVICE_ROLES, "instance_id": ("x-1",), "request_id": ("r-1",)}


def every_subject() -> list[tuple[str, str]]:
    """(Subjects member, subject) for every public member, called with sample arguments; a member
    with a parameter this test does not know fails here, so a new subject cannot go unchecked."""
    out = []
    for name, member in inspect.getmembers(Subjects):
        if name.startswith("_") or name == "prefix":
            continue
        if isinstance(member, property):
            out.append((name, getattr(S, name)))
            continue
        params = list(inspect.signature(member).parameters.values())[1:]
        unknown = [p.name for p in params if p.name not in SAMPLES]
        assert not unknown, f"Subjects.{name}: teach this test sample values for {unknown}"
        calls: list[dict] = [{}]
        for p in params:
            options = [*SAMPLES[p.name], *([None] if p.default is None else [])]
            calls = [{**c, p.name: v} for c in calls for v in options]
        out += [(name, getattr(S, name)(**{k: v for k, v in c.items() if v is not None})) for c in calls]
    return out


ROLE_PERMS = {role: permissions(role, S, "x-1") for role in SERVICE_ROLES}
OPERATOR = operator_subjects(S)


@pytest.mark.parametrize(("member", "subject"), every_subject())
def test_every_subject_has_a_sender_and_a_receiver(member: str, subject: str) -> None:
    by_operator = any(subject_matches(p, subject) for p in OPERATOR)
    receivers = [r for r, p in ROLE_PERMS.items() if p.can_subscribe(subject)]
    senders = [r for r, p in ROLE_PERMS.items() if p.can_publish(subject)]
    if "*" in subject.split("."):  # a pattern: some role subscribes to it, or is allowed to send to it
        assert receivers or senders or by_operator, f"Subjects.{member} ({subject}): no role uses it"
        return
    assert receivers or by_operator, f"Subjects.{member} ({subject}): no role may subscribe to it"
    assert senders or by_operator, f"Subjects.{member} ({subject}): no role may publish it"


def test_the_issues_rules() -> None:
    fe, w0 = permissions("frontend", S, "frontend-0"), permissions("worker", S, "worker-0")
    assert not fe.can_publish(S.kvtransfer_push("worker-0")) and not fe.can_subscribe(S.worker_generate("worker-0"))
    for i in ("worker-0", "worker-1"):  # a worker never sends generate work, not even to itself
        assert not w0.can_publish(S.worker_generate(i)) and not w0.can_publish(S.worker_abort(i))
    assert w0.can_subscribe(S.worker_generate("worker-0")) and not w0.can_subscribe(S.worker_generate("worker-1"))
    assert not w0.can_subscribe(S.kvtransfer_push("worker-1")) and not w0.can_subscribe(S.frontend_stream_all("f"))
    assert w0.can_publish(S.worker_handoff("decode-1")) and w0.can_publish(S.kvtransfer_push("decode-1"))
    assert w0.can_publish(S.heartbeat("worker", "worker-0")) and not w0.can_publish(S.heartbeat("worker", "worker-1"))
    # a worker reads the KV events (the broker's tiers: kv_share's fetch), never the broker's requests
    assert w0.can_subscribe(S.kvbroker_events) and not w0.can_subscribe(S.kvbroker_get)
    drain = S.drain("worker", "worker-1")
    assert [r for r in SERVICE_ROLES if permissions(r, S).can_publish(drain)] == ["planner"]
    for role in SERVICE_ROLES:  # nobody but the planner sends control messages; no service role reads everything
        p = permissions(role, S)
        assert role == "planner" or not p.can_publish(S.drain("tokenizer", "tokenizer-0"))
        assert not any(x in (">", "*.>") or x.startswith("_INBOX.>") for x in p.subscribe + p.publish if x != ">")
        assert not p.can_subscribe("_INBOX.admin.x.1")  # another user's replies
    assert permissions(ADMIN, S).can_publish(drain)


def test_subject_matching() -> None:
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.c.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert subject_matches("a.b", "a.b") and not subject_matches("a.b", "a.b.c") and not subject_matches("a.b.c", "a.b")


def test_users_and_credentials_files(tmp_path) -> None:
    users = BusUsers(S)
    w0 = users.add("worker", "worker-0")
    assert users.add("worker", "worker-0") == w0 and w0.user == "worker-0" and w0.inbox == "_INBOX.worker.worker-0"
    with pytest.raises(ValueError):
        users.add("frontend", "worker-0")  # one user, one role
    anyw = users.add("worker")
    assert anyw.user == "worker" and len({w0.password, anyw.password}) == 2
    path = write_credentials(tmp_path / "planner-0.json", {"planner-0": users.add("planner", "planner-0"), ANY: anyw})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials(path, "planner-0").user == "planner-0"
    assert load_credentials(path, "worker-ab12-0") == anyw  # the planner's workers: any id
    only = write_credentials(tmp_path / "w.json", {"worker-0": w0})
    with pytest.raises(ValueError, match="no bus credentials"):
        load_credentials(only, "worker-1")
    assert Credentials(**json.loads(only.read_text())["worker-0"]) == w0


def test_nats_server_accepts_the_config(tmp_path) -> None:
    users = BusUsers(S)
    for role in SERVICE_ROLES:
        users.add(role, f"{role}-0")
        users.add(role)
    users.add(ADMIN)
    conf = tmp_path / "nats.conf"
    conf.write_text(NatsServer(authorization=users.authorization()).config())
    out = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
