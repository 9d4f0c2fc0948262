"""FrontendService: the bus side of the HTTP frontend (tokenizer client, stream router, limits)."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from moebus.shared.errors import NoResponders, RequestTimeout, ServiceError, context_length_exceeded
from moebus.shared.messages import (
    DetokenizeReply,
    DetokenizeRequest,
    EncodeReply,
    EncodeRequest,
    ImageEmbedding,
    RenderReply,
    RenderRequest,
    SamplingOptions,
)
from moebus.shared.service import Service

from .admission.access import AccessLog
from .admission.admission import Admission
from .admission.tenants import KeyRing, Tenant
from .choices.choice import ChoiceState, Detok
from .choices.latency import Latencies, TimedChoice
from .config import FrontendConfig
from .errors import APIError
from .fleet.encoders import EncoderPicker
from .fleet.fleet import FleetView
from .fleet.peers import FrontendPeers
from .fleet.readiness import WorkerWatch
from .prompts.images import image_input
from .prompts.local_render import LocalRenderer
from .routing.finish import finish_generation
from .routing.generation import Generation
from .routing.router import StreamRouter
from .routing.spans import generation_span


class FrontendService(Service):
    name = "frontend"

    def __init__(self, cfg: FrontendConfig, access: AccessLog | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.access = access or AccessLog()  # the HTTP request each task handles (its access line)
        self.cfg: FrontendConfig = cfg
        self.router: StreamRouter | None = None
        self.encoders: EncoderPicker | None = None  # when images are accepted
        self.fleet = FleetView()  # every instance's heartbeats: `moebus status`, the fleet gauges
        self.fleet.export(self.metrics)
        self.workers = WorkerWatch(self.fleet)  # which models have a ready worker (/ready)
        self.local: LocalRenderer | None = None  # prompts rendered in this process (cfg.local_render)
        m = self.metrics
        self.m_http = m.counter("http_requests_total", "HTTP requests", ["route", "status"])
        self.m_latency = m.histogram("http_request_seconds", "HTTP request latency", ["route"])
        self.m_ttft = m.histogram("time_to_first_token_seconds", "Request start to first token")
        self.m_tokens = m.counter("completion_tokens_total", "Completion tokens returned")
        self.m_inflight = m.gauge("inflight_generations", "Generations in flight")
        self.latencies = Latencies(m)  # moebus:time_to_first_token_seconds etc., as clients see them
        self.keyring = KeyRing.from_config(cfg)  # a bad keys file fails the start
        self.peers = FrontendPeers(self.instance_id, m)  # the tenants' limits are split between the frontends
        self.admission = Admission(cfg.admission, m, frontends=self.peers.count)

    async def setup(self) -> None:
        if self.cfg.local_render is not None:
            self.local = await LocalRenderer.load(self.cfg.local_render, self.tracing)
        self.router = StreamRouter(self.bus, self.subjects, self.instance_id, self.cfg, self.metrics,
                                   incarnation=self.incarnation)
        self.fleet.on_return = self.router.heard_again
        await self.router.start()
        await self.peers.start(self.bus, self.subjects)
        await self.fleet.start(self.bus, self.subjects)
        if self.cfg.accept_images:
            self.encoders = EncoderPicker(self.bus, self.subjects)
            await self.encoders.start()

    def stats(self) -> dict[str, Any]:
        return {"inflight": len(self.router) if self.router else 0}

    def check_model(self, model: str) -> None:
        if (rec := self.access.record()) is not None:
            rec.model = model
        if model not in self.cfg.models:
            raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")

    async def render(self, req: RenderRequest) -> RenderReply:
        """Prompt token ids; the tokenizer refuses prompts that leave no room in the context."""
        req.max_prompt_tokens = self.cfg.limits.max_model_len
        try:
            if self.local is not None and self.local.serves(req):
                return await self.local.render(req)
            return await self.bus.request(self.subjects.tokenizer_render, req, RenderReply,
                                          timeout=self.cfg.tokenizer_timeout_s,
                                          wait_for_responders_s=self.cfg.restart_wait_s, idempotent=True)
        except ServiceError as e:
            raise APIError.from_service_error(e) from None

    async def detokenize_all(self, model: str, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens skipped), in one tokenizer call."""
        req = DetokenizeRequest(model=model, token_ids=token_ids, finished=True)
        try:
            reply = await self.bus.request(self.subjects.tokenizer_detokenize, req, DetokenizeReply,
                                           timeout=self.cfg.tokenizer_timeout_s,
                                           wait_for_responders_s=self.cfg.restart_wait_s, idempotent=True)
        except ServiceError as e:
            raise APIError.from_service_error(e) from None
        return reply.held + reply.text

    async def encode_images(self, model: str, urls: list[str]) -> EncodeReply:
        """The encoder's rows for each image (in order); 400 when this server takes no images."""
        if not self.cfg.accept_images:
            raise APIError(400, f"the model '{model}' does not accept image inputs on this server",
                           param="messages", code="images_not_supported")
        if len(urls) > self.cfg.limits.max_images:
            raise APIError(400, f"{len(urls)} images in one request; the limit is {self.cfg.limits.max_images}",
                           param="messages")
        req = EncodeRequest(model=model, images=[image_input(u) for u in urls])
        target = self.encoders.pick(req.images[0].data or req.images[0].url or "") if self.encoders else None
        try:
            if target is not None:
                try:
                    return await self.bus.request(self.subjects.encoder_encode_on(target), req, EncodeReply,
                                                  timeout=self.cfg.encoder_timeout_s, idempotent=True)
                except (NoResponders, RequestTimeout):
                    # Gone since its last beat, or killed holding the request (its subscription
                    # outlived it a moment and swallowed it): any encoder will do, a restarted one too.
                    self.encoders.forget(target)
            return await self.bus.request(self.subjects.encoder_encode, req, EncodeReply,
                                          timeout=self.cfg.encoder_timeout_s,
                                          wait_for_responders_s=self.cfg.restart_wait_s, idempotent=True)
        except ServiceError as e:
            raise APIError.from_service_error(e) from None

    def check_context(self, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """400 unless the prompt, plus max_tokens when given, fits in the context (None: up to the rest)."""
        most = self.cfg.limits.max_model_len
        if prompt_tokens >= most:
            raise APIError.from_service_error(context_length_exceeded(most, prompt_tokens, param))
        if max_tokens is not None and prompt_tokens + max_tokens > most:
            raise APIError.from_service_error(context_length_exceeded(most, prompt_tokens, param, max_tokens))

    def choices(self, first_index: int, params: SamplingOptions, prompt_ids: list[int],
                model: str) -> list[ChoiceState]:
        def detok() -> Detok:
            return Detok(self.bus, self.subjects, model, self.cfg.tokenizer_timeout_s, list(params.stop),
                         params.include_stop_str_in_output, context=prompt_ids, wait_s=self.cfg.restart_wait_s,
                         paused_s=self.cfg.stream_idle_timeout_s)  # a paused tokenizer: as long as a worker

        clock = self.latencies.current.get()  # of the generation just entered (its TTFT, ITL)
        return [TimedChoice(first_index + i, detok(), clock=clock) for i in range(params.n)]

    def tokens_of(self, prompt_ids: list[int], params: SamplingOptions) -> int:
        """What a request may hold at most: its prompt and every choice's longest output."""
        most = params.max_tokens if params.max_tokens is not None else self.cfg.limits.max_model_len - len(prompt_ids)
        return len(prompt_ids) + params.n * most

    @asynccontextmanager
    async def generation(self, model: str, prompt_ids: list[int], params: SamplingOptions,
                         images: list[ImageEmbedding] = (), tenant: Tenant | None = None,
                         owner: str = "") -> AsyncIterator[Generation]:
        """`_generation` inside its `generate <model>` span (routing/spans.py). owner: the API call of
        several generations (a completions call's prompts): one fair share on a worker."""
        before, gen = self.latencies.current.get(), None
        with generation_span(self.tracing, model, len(prompt_ids), params) as span:
            try:
                async with self._generation(model, prompt_ids, params, images, tenant, owner) as gen:
                    yield gen
            finally:
                clock = self.latencies.current.get()
                finish_generation(self.tracing, span, gen, clock if clock is not before else None)

    @asynccontextmanager
    async def _generation(self, model: str, prompt_ids: list[int], params: SamplingOptions,
                          images: list[ImageEmbedding] = (), tenant: Tenant | None = None,
                          owner: str = "") -> AsyncIterator[Generation]:
        """A routed generation, aborted on its worker if we leave early (client gone, error); it
        holds its tenant's tokens and a place in the capacity until it ends (admission/admission.py)."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        tenant = tenant or self.keyring.default
        async with self.admission.admit(tenant, self.tokens_of(prompt_ids, params)):
            if len(self.router) >= self.cfg.max_inflight:
                raise APIError(503, "too many requests in flight", type="service_unavailable", code="overloaded",
                               retry_after=1)
            clock = self.latencies.start(model)
            gen = self.router.new(f"gen-{uuid.uuid4().hex}", model, prompt_ids, params, list(images),
                                  priority=tenant.limits.priority, owner=owner, kv=self.workers.kv_space(model))
            try:
                await gen.start()
            except ServiceError as e:
                raise APIError.from_service_error(e) from None
            self.m_inflight.set(len(self.router))
            try:
                yield gen
            finally:
                await gen.close()
                clock.close()
                if (rec := self.access.record()) is not None:
                    rec.generation(gen.request_id, len(prompt_ids), clock.n_tokens, clock.first_at)
                self.m_inflight.set(len(self.router))
