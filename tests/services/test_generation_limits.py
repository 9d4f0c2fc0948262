"""The frontend's generation bounds as the balancer and the workers check them (shared/limits.py),
and `moebus up` giving all three the same values."""
from __future__ import annotations

import pytest

from moebus.services.balancer.config import BalancerConfig
from moebus.services.frontend.config import FrontendConfig, RequestLimits
from moebus.services.launcher import Stack, StackConfig
from moebus.services.worker.config import WorkerConfig
from moebus.shared.errors import ErrorCode, ServiceError
from moebus.shared.limits import GenerationLimits
from moebus.shared.messages import GenerateRequest, SamplingOptions
from moebus.shared.messages.generate import ResumedChoice

LIM = GenerationLimits(max_model_len=100, max_n=4, max_stop_sequences=2, max_stop_chars=8, max_stop_token_ids=3,
                       max_logprobs=5, max_images=0)


def _req(prompt: int = 10, **params) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="toy", prompt_token_ids=[1] * prompt, reply_to="x",
                           params=SamplingOptions(**params))


@pytest.mark.parametrize(("req", "param"), [
    (_req(n=5), "params.n"),
    (_req(n=0), "params.n"),
    (_req(0), "prompt_token_ids"),
    (_req(100), "prompt_token_ids"),
    (_req(10, max_tokens=91), "params.max_tokens"),
    (_req(10, max_tokens=10**9), "params.max_tokens"),
    (_req(10, max_tokens=0), "params.max_tokens"),
    (_req(min_tokens=101), "params.min_tokens"),
    (_req(stop=["a", "b", "c"]), "params.stop"),
    (_req(stop=["x" * 9]), "params.stop"),
    (_req(stop_token_ids=[1, 2, 3, 4]), "params.stop_token_ids"),
    (_req(logprobs=6), "params.logprobs"),
    (_req(n=2).model_copy(update={"resume": [ResumedChoice(index=2, token_ids=[])]}), "resume"),
    (_req(10).model_copy(update={"resume": [ResumedChoice(index=0, token_ids=[0] * 91)]}), "resume"),
])
def test_over_a_bound_is_bad_request_naming_the_field(req: GenerateRequest, param: str) -> None:
    with pytest.raises(ServiceError) as e:
        LIM.check(req)
    assert e.value.code is ErrorCode.BAD_REQUEST and e.value.param == param, e.value


def test_within_the_bounds_passes() -> None:
    LIM.check(_req(10, n=4, max_tokens=90, min_tokens=90, stop=["a", "12345678"], stop_token_ids=[1, 2, 3],
                   logprobs=5))
    LIM.check(_req(99, max_tokens=None))  # unset max_tokens: the rest of the context
    LIM.check(_req(10, n=2, max_tokens=90).model_copy(update={"resume": [ResumedChoice(index=1, token_ids=[0] * 5)]}))


def test_defaults_agree() -> None:
    """The three configs' defaults are the same bounds; the frontend's RequestLimits is a GenerationLimits."""
    front = FrontendConfig().limits
    assert isinstance(front, GenerationLimits) and front.generation_limits() == GenerationLimits()
    assert BalancerConfig().limits == WorkerConfig().limits == GenerationLimits()
    assert RequestLimits(max_n=3).generation_limits() == GenerationLimits(max_n=3)


def test_worker_context_follows_its_engine() -> None:
    assert WorkerConfig(engine={"max_model_len": 4096}).limits.max_model_len == 4096
    assert WorkerConfig(engine={"max_model_len": 4096}, limits={"max_model_len": 2048}).limits.max_model_len == 2048


def test_launcher_gives_every_service_the_same_limits() -> None:
    stack = Stack(StackConfig(model="toy", workers=2, frontends=2, engine={"max_model_len": 1000}, autoscale=(1, 2),
                              frontend={"limits": {"max_n": 3, "max_body_bytes": 4096}}))
    want = GenerationLimits(max_model_len=1000, max_n=3)
    configs = stack.service_configs()
    fronts = [c for s, c in configs if s == "frontend"]
    assert [(c.instance_id, c.port) for c in fronts] == [("frontend-0", 8000), ("frontend-1", 8001)]
    assert all(c.limits.generation_limits() == want and c.limits.max_body_bytes == 4096 for c in fronts)
    assert [c.limits for s, c in configs if s in ("balancer", "worker")] == [want] * 2  # autoscale: 1 worker
    planner = next(c for s, c in configs if s == "planner")
    assert GenerationLimits(**planner.local.worker["limits"]) == want  # the workers it starts agree too
    assert stack.urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
