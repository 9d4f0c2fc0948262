"""The HTTP process never imports torch: a real stack on the embedded SmolLM2 whose frontend runs
with torch made unimportable (a meta-path finder that refuses it and writes down who asked) serves
a chat completion through the openai SDK, its prompt rendered in the frontend's own process
(local_render, the default). The import contract in pyproject.toml checks the same statically."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from moebus.services.launcher import Stack, StackConfig
from moebus.shared.nats_server import free_port

from ..conftest import skip_without_smollm2

# Run as `python -c WRAPPER <frontend flags>`: the blocker first, then the frontend's main.
BLOCKER = """
import importlib.abc, sys, traceback

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            with open({tries!r}, "a") as f:
                f.write("".join(traceback.format_stack()) + "\\n")
            raise ImportError(name + " is blocked in this process")
        return None

sys.meta_path.insert(0, NoTorch())
sys.modules.pop("torch", None)
"""
RUN_FRONTEND = """
import runpy
runpy.run_module("moebus.services.frontend", run_name="__main__", alter_sys=True)
"""


class TorchFreeFrontend(Stack):
    """The launcher's stack, its frontend started under the torch blocker."""

    def __init__(self, cfg: StackConfig, tries: Path) -> None:
        super().__init__(cfg)
        self.tries = tries

    def _popen(self, instance_id: str, service: str, cmd: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        if service == "frontend" and cmd[1:3] == ["-m", "moebus.services.frontend"]:
            cmd = [sys.executable, "-c", BLOCKER.format(tries=str(self.tries)) + RUN_FRONTEND, *cmd[3:]]
        return super()._popen(instance_id, service, cmd, env)


def test_the_blocker_refuses_torch(tmp_path: Path) -> None:
    tries = tmp_path / "tries"
    code = BLOCKER.format(tries=str(tries)) + "import torch\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0
    assert tries.exists()


async def test_a_frontend_without_torch_serves_a_chat_completion(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the worker's
    skip_without_smollm2()
    tries, logs = tmp_path / "torch-tries", tmp_path / "logs"
    logs.mkdir()
    cfg = StackConfig(port=free_port(), host="127.0.0.1", model="smollm2", heartbeat_interval_s=0.25,
                      log_dir=str(logs), workers=1, engine={"num_kv_blocks": 64, "max_num_seqs": 2},
                      ready_timeout_s=180)
    with TorchFreeFrontend(cfg, tries) as stack:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        r = await client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                                 messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content and r.usage.prompt_tokens > 10
    log = (logs / "frontend-0.log").read_text()
    assert not tries.exists(), tries.read_text()
    assert "could not load the tokenizer" not in log, log[-4000:]  # rendered here, not in the tokenizer service
