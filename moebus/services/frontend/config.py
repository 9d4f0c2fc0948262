from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moebus.shared.limits import GenerationLimits
from moebus.shared.service import ServiceConfig


class RequestLimits(GenerationLimits):
    """Bounds on one request, checked at the edge before anything of it goes on the bus.

    Violations are 400s naming the field (a body over `max_body_bytes`: 413; a body slower than
    `body_timeout_s`: 408 and the connection closed). The generation bounds (GenerationLimits:
    max_model_len, max_n, stops, logprobs, images) are checked again by the balancer and the
    workers, which `moebus up` gives the same values; `max_model_len` must match the workers'
    engine (EngineConfig.max_model_len; `moebus up` copies it over).
    """

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)  # the HTTP body (aiohttp client_max_size)
    max_prompts: int = Field(64, ge=1)  # /v1/completions: prompts in one request
    max_messages: int = Field(2048, ge=1)  # /v1/chat/completions: messages in one request
    max_schema_bytes: int = Field(64 * 1024, ge=16)  # response_format's JSON schema, as JSON
    max_schema_depth: int = Field(64, ge=1)  # its nesting (the bus encoder stops at 255)
    max_json_depth: int = Field(128, ge=8, le=1024)  # nesting of the whole body (orjson stops at 1024)
    # Slow clients (slow-loris): a connection must deliver a request's headers within
    # header_timeout_s of opening or of its previous response, else it is closed without a reply
    # (aiohttp's keepalive_timeout, which is also how long an idle keep-alive connection stays:
    # behind a proxy keep it above the proxy's upstream keep-alive). The body must then arrive
    # within body_timeout_s: 408.
    header_timeout_s: float = Field(60.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _schema_fits(self) -> RequestLimits:
        if self.max_json_depth < self.max_schema_depth + 3:  # {"response_format": {"json_schema": {"schema"
            raise ValueError(f"max_json_depth must be >= max_schema_depth + 3 ({self.max_schema_depth + 3})")
        return self


class TenantLimits(BaseModel):
    """One tenant's share and limits: a keys file's `tenants` entry (docs/tenants.md)."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0)  # its share of the frontend's capacity while requests wait for it
    priority: int = 0  # order in the engines' queues: lower runs first (as in vLLM)
    rate: float | None = Field(None, gt=0)  # requests per second, sustained; None: unlimited
    burst: int | None = Field(None, ge=1)  # requests at once above the rate; None: max(1, ceil(rate))
    # Prompt + max output tokens of its requests in flight (waiting or running); None: unlimited.
    max_tokens_in_flight: int | None = Field(None, ge=1)


class AdmissionConfig(BaseModel):
    """When generations start (docs/tenants.md). With no capacity set every request starts at once
    and the engines' queues order them; with one, requests beyond it wait at the frontend."""

    model_config = ConfigDict(extra="forbid")

    max_running: int | None = Field(None, ge=1)  # generations started at once (~ the fleet's batch slots)
    max_running_tokens: int | None = Field(None, ge=1)  # their prompt + max output tokens
    fair_share: bool = True  # waiting requests start by weighted fair share of tokens; off: first come
    max_wait_s: float = Field(30.0, gt=0)  # a request still waiting after this gets a 429
    default_tenant: TenantLimits = TenantLimits()  # requests with an `api_keys` key, or all when auth is off


class LocalRender(BaseModel):
    """The tokenizer service's model and template, for a frontend that renders prompts itself
    (prompts/local_render.py): the same tokenizer loaded in this process, so no bus round trip comes
    before routing. Detokenizing and DeepSeek-V4's recipe prompts stay with the tokenizer service."""

    model_config = ConfigDict(extra="forbid")

    model: str  # as TokenizerConfig.model: an engine model name or checkpoint dir; "toy"
    served_model_name: str | None = None  # the name clients use; default: `model`
    chat_template: str | None = None  # a jinja file that replaces the model's (TokenizerConfig.chat_template)


class FrontendConfig(ServiceConfig):
    host: str = "0.0.0.0"
    port: int = 8000
    models: list[str] = ["smollm2"]  # model names served (what the workers advertise)
    # Flat keys of the `default` tenant (admission/tenants.py); none here, in api_keys_file or keys_file: no auth.
    # On the command line `ps` shows them to every user: prefer api_keys_file.
    api_keys: list[str] = []
    api_keys_file: str | None = None  # flat keys, one a line, read at start (`moebus up` writes one, 0600)
    max_inflight: int = Field(1024, ge=1)  # concurrent generations; beyond: 503 + Retry-After
    # Generation requests (streamed or not, body still arriving included) open at once from one
    # client address; beyond: 429 + Retry-After. 0: no limit (behind a proxy every client shares
    # its address). HTTP/1.1 carries one request at a time per connection.
    max_concurrent_per_client: int = Field(256, ge=0)
    keys_file: str | None = None  # JSON: hashed API keys -> tenants and their limits (docs/tenants.md)
    admission: AdmissionConfig = AdmissionConfig()
    limits: RequestLimits = RequestLimits()
    tokenizer_timeout_s: float = 10.0
    # Render prompts in this process with this tokenizer (`moebus up` sets it; it loads torch for a
    # real model's tokenizer); None, or a tokenizer that fails to load: the tokenizer service renders.
    local_render: LocalRender | None = None
    # (a balancer still subscribed but silent, i.e. paused, is waited for stream_idle_timeout_s)
    route_timeout_s: float = 15.0
    # No reply to a route within this long: asked again (same request id and attempt), until
    # route_timeout_s. A balancer killed holding the request never answers; a balancer answers a
    # repeat with the first ask's result (balancer/route_memo.py), so a slow route is not doubled.
    route_attempt_s: float = Field(2.0, gt=0)
    stream_idle_timeout_s: float = 120.0  # no chunk for this long: give up on the request
    # Bus blips (routing/generation.py): a gap in a stream's chunk numbers is filled from the worker's
    # replay buffer once it has lasted gap_wait_s; a stream whose bus stays down bus_outage_s fails (503).
    gap_wait_s: float = Field(0.2, ge=0)
    # (120 s: a nats-server paused a minute, e.g. its VM frozen, loses no stream; RELIABILITY.md)
    bus_outage_s: float = Field(120.0, gt=0)
    # While no tokenizer or balancer answers (a crashed one is being restarted), requests wait this
    # long for one instead of failing: nobody got them, so asking again is safe.
    restart_wait_s: float = 15.0
    # Chat image parts go to the vision encoder service; off: they are refused with a 400 (no
    # encoder runs, or the model cannot take images).
    accept_images: bool = False
    encoder_timeout_s: float = 10.0  # a request to a killed encoder is asked again after this
    # Moves of one request to another worker (its worker died, drained or failed retryably); the
    # open choices go on from the tokens already sent (routing/generation.py).
    max_migrations: int = Field(3, ge=0)
    # Workers one request may break (they died, or their engine failed, while holding it) before
    # it is failed instead of sent to the next: a poison request cannot walk the fleet.
    max_worker_failures: int = Field(2, ge=1)
    # model -> the parser that reads its function calls out of free text (tool_choice auto;
    # tool_parsers.PARSERS, or deepseek_v4 / deepseek_v4.1: reasoning and DSML calls, by deepseek-recipe;
    # `moebus up` sets it for a DeepSeek-V4 folder); a model not listed: hermes (<tool_call>{json}</tool_call>).
    tool_call_parsers: dict[str, str] = {}

    def tool_parser(self, model: str) -> str:
        """The parser of `model`'s function calls (tool_call_parsers, else hermes)."""
        return self.tool_call_parsers.get(model, "hermes")
