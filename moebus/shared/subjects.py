"""Every NATS subject and queue group the services use, in one place.

Layout: ``moebus.v1.<service>.<endpoint>[.<instance_id>[.<request_id>]]``: lowercase dotted
tokens, ids only in the last positions, wildcards only on subscribe.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[a-z0-9_-]+$")


def check_token(value: str) -> str:
    """Ids become subject tokens: no dots, spaces, wildcards or upper case."""
    if not _TOKEN.match(value):
        raise ValueError(f"not a valid subject token: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject builder; `prefix` lets tests or tenants isolate themselves on one server."""

    prefix: str = "moebus.v1"

    def _s(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    # Per-service control plane (every Service answers these).
    def health(self, service: str, instance_id: str | None = None) -> str:
        return self._s(service, "health", instance_id) if instance_id else self._s(service, "health")

    def ready(self, service: str, instance_id: str | None = None) -> str:
        return self._s(service, "ready", instance_id) if instance_id else self._s(service, "ready")

    def stats(self, service: str, instance_id: str) -> str:
        return self._s(service, "stats", instance_id)

    def drain(self, service: str, instance_id: str) -> str:
        """Ask one instance to drain and exit, as SIGTERM does (the planner's scale-in)."""
        return self._s(service, "drain", instance_id)

    def probe(self, service: str, instance_id: str) -> str:
        """Private to the instance: used once at startup to see that its subscriptions route."""
        return self._s(service, "probe", instance_id)

    def heartbeat(self, service: str, instance_id: str) -> str:
        return self._s(service, "heartbeat", instance_id)

    def heartbeat_all(self, service: str) -> str:
        return self._s(service, "heartbeat", "*")

    # Tokenizer: stateless, load-balanced by queue group.
    @property
    def tokenizer_render(self) -> str:
        return self._s("tokenizer", "render")

    @property
    def tokenizer_detokenize(self) -> str:
        return self._s("tokenizer", "detokenize")

    # Encoder: stateless image encoder, load-balanced by queue group.
    @property
    def encoder_encode(self) -> str:
        return self._s("encoder", "encode")

    def encoder_encode_on(self, instance_id: str) -> str:
        """One encoder: the frontend sends an image to the instance whose cache is likely to hold it."""
        return self._s("encoder", "encode", instance_id)

    # Balancer: stateless router (each replica keeps its own heartbeat table).
    @property
    def balancer_route(self) -> str:
        return self._s("balancer", "route")

    @property
    def balancer_worker_lost(self) -> str:
        return self._s("balancer", "worker_lost")

    # Worker: routed work goes to one instance.
    def worker_generate(self, instance_id: str) -> str:
        return self._s("worker", "generate", instance_id)

    def worker_abort(self, instance_id: str) -> str:
        return self._s("worker", "abort", instance_id)

    def worker_handoff(self, instance_id: str) -> str:
        """Prefill -> decode worker: the first token of a split request."""
        return self._s("worker", "handoff", instance_id)

    def worker_handoff_beat(self, instance_id: str) -> str:
        """Prefill -> decode worker: the split requests still being prefilled or handed over."""
        return self._s("worker", "handoffbeat", instance_id)

    def worker_replay(self, instance_id: str) -> str:
        """Chunks this worker already sent for a request, again (the frontend lost some in a bus blip)."""
        return self._s("worker", "replay", instance_id)

    @property
    def worker_abort_all(self) -> str:
        """Abort broadcast, for a request whose worker the sender does not know."""
        return self._s("worker", "abort")

    # KV broker: one index + shared tiers (optional; every caller degrades without it).
    @property
    def kvbroker_events(self) -> str:
        """KVEvent publishes from holders (workers)."""
        return self._s("kvbroker", "events")

    @property
    def kvbroker_query(self) -> str:
        return self._s("kvbroker", "query")

    @property
    def kvbroker_get(self) -> str:
        return self._s("kvbroker", "get")

    @property
    def kvbroker_put(self) -> str:
        """KV transfer address of the broker's tiers (send a KV payload of blocks here)."""
        return self._s("kvbroker", "put")

    @property
    def kvbroker_stats(self) -> str:
        """BrokerStats of whichever broker answers (the per-instance `stats` is the Service's)."""
        return self._s("kvbroker", "stats")

    # KV transfers: chunked payloads to one worker (prefill -> decode pushes, broker get replies).
    def kvtransfer_push(self, instance_id: str) -> str:
        return self._s("kvtransfer", "push", check_token(instance_id))

    @property
    def kvtransfer_push_all(self) -> str:
        """Every worker's KV receive address (a pattern: senders' permissions, not a publish subject)."""
        return self._s("kvtransfer", "push", "*")

    # Planner: replica-count decisions (broadcast; anyone may watch).
    @property
    def planner_decision(self) -> str:
        return self._s("planner", "decision")

    # Frontend: per-request token streams (one wildcard subscription per frontend).
    def frontend_stream(self, instance_id: str, request_id: str) -> str:
        return self._s("frontend", "stream", instance_id, request_id)

    def frontend_stream_all(self, instance_id: str) -> str:
        return self._s("frontend", "stream", instance_id, "*")

    def frontend_chunks(self, instance_id: str) -> str:
        """A worker's chunks for this frontend's streams, an engine step's together (TokenChunks)."""
        return self._s("frontend", "chunks", instance_id)


class Queues:
    """Queue groups of stateless endpoints: one member of the group gets each message."""

    TOKENIZER = "tokenizer"
    BALANCER = "balancer"
    ENCODER = "encoder"
