"""A bf16 MoE decoder's batch-1 C step (platforms/cpu/moe_decode.py on bf16 panels) against the
module path of the same model, teacher-forced over a prompt's last tokens: the step runs (its plan
is built) and its logits are the module path's bits (it rounds to bf16 wherever the module path
holds a bf16 tensor, on the same panel kernels), so a lone request answers as it would batched."""
from __future__ import annotations

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.model_runner import allocate_kv_caches
from moebus.kernels.decode_stack import DecodeStack, bf16_available, cpu_kernel_available
from moebus.platforms.cpu.packed_linear import panels_wanted

from .paged_steps import BLOCK, MAX_BLOCKS, prompt, run
from .test_moe_quantized import _tiny

pytestmark = [pytest.mark.skipif(not (cpu_kernel_available() and bf16_available() and panels_wanted(torch.bfloat16)),
                                 reason="needs AVX512-BF16 without AMX (the bf16 panel kernels)")]

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "granite_moe")


def _caches(model, dtype: torch.dtype) -> list:
    return allocate_kv_caches(model.kv_cache_specs(), MAX_BLOCKS, BLOCK, dtype, torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_step_follows_the_module_path(family, tmp_path, monkeypatch):
    stepped = []  # what the C call returned each time (None: it refused, the module path ran)
    step_ids = DecodeStack.step_ids
    monkeypatch.setattr(DecodeStack, "step_ids", lambda *a: stepped.append(step_ids(*a)) or stepped[-1])
    hf = _tiny(family, tmp_path / family)
    bf16 = LLM(str(hf), num_kv_blocks=32, dtype="bfloat16").engine.model
    ids, n = prompt(28, seed=3, vocab=49152), 20
    fast, slow = _caches(bf16, torch.bfloat16), _caches(bf16, torch.bfloat16)
    for kv in (fast, slow):
        run(bf16, ids[:n], [0], [n], kv)  # the prompt through the modules
    for t in range(n, len(ids)):
        x = ids[t:t + 1]
        got = run(bf16, x, [t], [1], fast)
        assert len(stepped) == t - n + 1 and stepped[-1] is not None  # the C step ran
        hook = bf16.norm.register_forward_hook(lambda *a: None)  # a hook: the module path
        try:
            want = run(bf16, x, [t], [1], slow)
        finally:
            hook.remove()
        assert torch.equal(got, want), (t, (got - want).abs().max().item())
    for (k, v), (wk, wv) in zip(fast, slow, strict=True):  # the caches the two paths wrote
        assert torch.equal(k, wk) and torch.equal(v, wv)
