"""Who may send and receive what on the bus: one permission table, derived from Subjects.

Roles are the services plus `admin` (the launcher, operators, tests: the whole bus). A service
role may publish and subscribe only what its code sends and receives (`role_subjects`) plus the
control plane every Service has; answering a request it received needs no entry (the server's
`allow_responses`), and its own request inboxes live under `_INBOX.<role>.<user>.` so no one else
reads its replies. A user is one instance of a role (`moebus up` knows every id: a worker then
subscribes only to its own generate, abort, handoff and KV subjects and beats only under its own
id) or any instance of it (ANY: Kubernetes Deployments, the planner's workers).

Credentials are user/password pairs: nats-py and nats-server take them with no extra package
(nkeys need nkeys/pynacl, JWTs an operator and account setup). They reach a service in a JSON file
named by $MOEBUS_NATS_CREDS, never on a command line: `{"<client name>": {"user", "password",
"inbox"}, "*": {...}}`; a client takes the entry of its name (its instance id), else "*".
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from .subjects import Subjects, check_token

ADMIN = "admin"
SERVICE_ROLES = ("frontend", "tokenizer", "encoder", "balancer", "worker", "kvbroker", "planner")
ROLES = (*SERVICE_ROLES, ADMIN)
ANY = "*"  # a user for any instance of its role
CREDS_ENV = "MOEBUS_NATS_CREDS"  # path of this process's credentials file
TLS_CA_ENV = "MOEBUS_NATS_TLS_CA"  # PEM file the server's certificate is checked against


def role_subjects(role: str, s: Subjects, i: str = ANY) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of a service role beyond its control plane; i: its instance id or ANY."""
    match role:
        # The frontend is the authority for what generates: the bus has no API keys or tenants, so the
        # frontend role's credentials are what the balancer and workers trust (shared/limits.py: they
        # re-check a request's size, not who asked).
        case "frontend":  # chat requests in; token streams of its own requests back (replayed on request)
            return ([s.tokenizer_render, s.tokenizer_detokenize, s.encoder_encode, s.encoder_encode_on(ANY),
                     s.balancer_route, s.worker_abort(ANY), s.worker_abort_all, s.worker_replay(ANY)],
                    [s.frontend_stream_all(i), s.frontend_chunks(i), s.balancer_worker_lost,
                     # every service's beats: workers for /ready, encoders to pick one, the other frontends
                     # (each enforces 1/N of a tenant's limits), all of them for the fleet view (`moebus status`)
                     s.heartbeat(ANY, ANY)])
        case "tokenizer":
            return [], [s.tokenizer_render, s.tokenizer_detokenize]
        case "encoder":
            return [], [s.encoder_encode, s.encoder_encode_on(i)]
        case "balancer":  # routes to workers by their heartbeats and KV events; never streams or moves KV
            return ([s.worker_generate(ANY), s.worker_abort(ANY), s.balancer_worker_lost,
                     s.health("worker", ANY)],  # is a silent worker gone or paused (service._probe)
                    [s.balancer_route, s.heartbeat_all("worker"), s.kvbroker_events])
        case "worker":  # receives only its own work; sends streams, handoffs and KV, never generate
            return ([s.frontend_stream(ANY, ANY), s.frontend_chunks(ANY), s.worker_handoff(ANY), s.worker_handoff_beat(ANY),
                     s.kvtransfer_push_all, s.kvbroker_events, s.kvbroker_query, s.kvbroker_get, s.kvbroker_put,
                     s.health("frontend", ANY)],  # is a silent frontend gone or paused (leases.py)
                    [s.worker_generate(i), s.worker_abort(i), s.worker_handoff(i), s.worker_handoff_beat(i),
                     s.worker_abort_all, s.worker_replay(i), s.kvtransfer_push_all if i == ANY else s.kvtransfer_push(i),
                     s.balancer_worker_lost, s.heartbeat_all("frontend"),  # frontend beats: leases.py
                     s.kvbroker_events])  # the broker's tier events: fetch asks only for what it holds (kv_link.py)
        case "kvbroker":  # a get's blocks go to the reply address the worker named (a worker inbox)
            return ([inbox("worker", ">"), s.kvtransfer_push_all, s.kvbroker_events],  # events: its own tiers
                    [s.kvbroker_events, s.kvbroker_query, s.kvbroker_get, s.kvbroker_put, s.kvbroker_stats,
                     s.balancer_worker_lost])
        case "planner":  # the only service that sends control messages: drain, to workers
            return [s.planner_decision, s.drain("worker", ANY), s.health("worker", ANY)], [s.heartbeat_all("worker")]
    raise ValueError(f"unknown role {role!r}; one of {SERVICE_ROLES}")


def control_subjects(service: str, s: Subjects, i: str = ANY) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of shared.service.Service: health/ready/stats/drain in, heartbeats out,
    and its startup probe (a request to itself)."""
    return ([s.heartbeat(service, i), s.probe(service, i)],
            [s.health(service), s.health(service, i), s.ready(service), s.ready(service, i), s.stats(service, i),
             s.drain(service, i), s.probe(service, i)])


def operator_subjects(s: Subjects) -> list[str]:
    """What only operators (admin: the launcher, dashboards, tests) send or watch."""
    return [s.health(ANY), s.health(ANY, ANY), s.ready(ANY), s.ready(ANY, ANY), s.stats(ANY, ANY), s.drain(ANY, ANY),
            s.heartbeat(ANY, ANY), s.kvbroker_stats, s.planner_decision]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` one or more."""
    p, t = pattern.split("."), subject.split(".")
    for k, token in enumerate(p):
        if token == ">" and k == len(p) - 1:
            return len(t) > k
        if k >= len(t) or (token != "*" and token != t[k]):
            return False
    return len(p) == len(t)


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def can_publish(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.publish)

    def can_subscribe(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.subscribe)

    def to_nats(self) -> dict:
        """The `permissions` block of a user in nats-server's config."""
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)},
                "allow_responses": True}


def inbox(role: str, user: str) -> str:
    return f"_INBOX.{role}.{user}"


def permissions(role: str, s: Subjects, i: str = ANY, user: str | None = None) -> Permissions:
    """A user's permissions: role `role`, instance `i` (ANY: any instance), request inboxes of `user`."""
    if role == ADMIN:
        return Permissions((">",), (">",))
    pub, sub = role_subjects(role, s, i)
    cpub, csub = control_subjects(role, s, i)
    own = f"{inbox(role, user or (role if i == ANY else i))}.>"
    return Permissions(tuple(dict.fromkeys(pub + cpub)), tuple(dict.fromkeys([*sub, *csub, own])))


@dataclass(frozen=True, slots=True)
class Credentials:
    user: str
    password: str
    inbox: str = "_INBOX"  # request inbox prefix: its permissions let it subscribe there only

    def to_json(self) -> dict[str, str]:
        return {"user": self.user, "password": self.password, "inbox": self.inbox}


@dataclass(frozen=True, slots=True)
class BusUser:
    role: str
    credentials: Credentials
    permissions: Permissions


@dataclass(slots=True)
class BusUsers:
    """The users of one bus, each with a fresh password: the server's `authorization` block and
    every client's credentials come from here."""

    subjects: Subjects = field(default_factory=Subjects)
    users: dict[str, BusUser] = field(default_factory=dict)  # user name -> user

    def add(self, role: str, instance_id: str = ANY) -> Credentials:
        """The user of one instance of `role` (named after it), or of any (ANY: named after the role);
        made on first use."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        name = role if instance_id == ANY else check_token(instance_id)
        if name not in self.users:
            creds = Credentials(name, secrets.token_urlsafe(24), inbox(role, name))
            self.users[name] = BusUser(role, creds, permissions(role, self.subjects, instance_id, name))
        elif self.users[name].role != role:
            raise ValueError(f"bus user {name!r} is a {self.users[name].role}, not a {role}")
        return self.users[name].credentials

    def authorization(self) -> dict:
        """nats-server's `authorization` block (the server config holds the only other copy)."""
        return {"users": [{"user": u.credentials.user, "password": u.credentials.password,
                           "permissions": u.permissions.to_nats()} for u in self.users.values()]}

    def passwords(self) -> list[str]:
        return [u.credentials.password for u in self.users.values()]


def write_credentials(path: str | Path, entries: dict[str, Credentials]) -> Path:
    """A credentials file only its owner can read; entries: client name (or "*") -> credentials."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({name: c.to_json() for name, c in entries.items()}, f)
    return path


def load_credentials(path: str | Path, name: str) -> Credentials:
    """The entry for client `name` in a credentials file, else its "*" entry."""
    entries = json.loads(Path(path).read_text())
    entry = entries.get(name, entries.get(ANY))
    if entry is None:
        raise ValueError(f"{path} has no bus credentials for {name!r} and no {ANY!r} entry")
    return Credentials(entry["user"], entry["password"], entry.get("inbox", "_INBOX"))


def kube_secrets(subjects: Subjects = Subjects()) -> dict:
    """Kubernetes Secrets of a fresh set of users, one per role for any instance (pods of a
    Deployment share theirs): `nats-auth` (auth.conf, included by deploy/nats.yaml's config) and
    `moebus-bus-<role>` (creds.json, mounted into that role's pods; `admin` for operators)."""
    users = BusUsers(subjects)
    creds = {role: users.add(role) for role in ROLES}

    def secret(name: str, data: dict[str, str]) -> dict:
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name},
                "stringData": data}

    return {"apiVersion": "v1", "kind": "List", "items": [
        secret("nats-auth", {"auth.conf": f"authorization: {json.dumps(users.authorization())}\n"}),
        *(secret(f"moebus-bus-{role}", {"creds.json": json.dumps({ANY: c.to_json()})}) for role, c in creds.items())]}


if __name__ == "__main__":  # python -m moebus.shared.bus_auth [PREFIX] | kubectl apply -n moebus -f -
    import sys

    print(json.dumps(kube_secrets(Subjects(*sys.argv[1:2])), indent=1))
