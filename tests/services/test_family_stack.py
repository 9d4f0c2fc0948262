"""`moebus up --model DIR` for MoE families: the whole stack as real processes on a tiny Qwen3-MoE
and a tiny DeepSeek-V3 (MLA) checkpoint written by HF's own classes, driven with the openai SDK:
greedy text equal to the in-process engine's; the start-up summary names architecture, context
and dtype."""
from __future__ import annotations

import openai
import pytest

from moebus.engine.llm import LLM
from moebus.engine.models.tiny_checkpoints import write_tiny
from moebus.engine.sampling import SamplingParams
from moebus.services.launcher import Stack, StackConfig
from moebus.services.startup import summarize_model
from moebus.shared.nats_server import free_port

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

PROMPT = " ".join(f"<{i}>" for i in (5, 17, 300, 42, 9, 77, 123, 8, 64, 250, 31, 12))


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def family_dir(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=4))


@pytest.fixture(scope="module")
def stack(family_dir, tmp_path_factory):
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model=family_dir, served_model_name="tiny", workers=1,
                      heartbeat_interval_s=0.25, log_dir=str(tmp_path_factory.mktemp("logs")),
                      engine={"num_kv_blocks": 64, "max_num_seqs": 8, "dtype": "float32"}, ready_timeout_s=180)
    with Stack(cfg) as s:
        yield s


async def test_completions_match_the_engine_in_process(stack: Stack, family_dir: str) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    r = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    streamed = "".join([ch.choices[0].text async for ch in stream if ch.choices])
    local = LLM(family_dir, dtype="float32", num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    assert r.usage.completion_tokens == len(local.token_ids) and r.usage.prompt_tokens == 12
    assert r.choices[0].text == local.text == streamed


def test_start_up_summary_names_architecture_context_and_dtype(family_dir: str) -> None:
    s = summarize_model(family_dir, {"dtype": "float32"})
    assert s.architecture in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
    assert (s.trained_context, s.context, s.dtype) == (4096, 4096, "float32")  # trained context, under the cap
    assert summarize_model(family_dir, {"max_model_len": 1024}).context == 1024
    assert str(s) == f"{s.architecture}, context 4096 tokens, float32"
