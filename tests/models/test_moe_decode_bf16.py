"""A bf16 MoE decoder's batch-1 C step (platforms/cpu/moe_decode.py on bf16 panels) against the
module path of the same model and both against the float32 model, teacher-forced over a prompt's
last tokens (tiny random checkpoints have near-ties everywhere, so free-running greedy tokens part
on bf16 noise alone): the step runs, its logits are the module path's to bf16 rounding, and they are
as close to float32's as the module path's (it keeps the residual stream in float32 where the
module path rounds it to bf16 at every add)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.loader.gguf_cache import converted_dir
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.models.tiny_checkpoints import write_tiny
from moebus.kernels.decode_stack import bf16_available, cpu_kernel_available
from moebus.platforms.cpu.packed_linear import panels_wanted
from moebus.text.gguf import embedded_gguf_path

from .paged_steps import BLOCK, MAX_BLOCKS, prompt, run

pytestmark = [pytest.mark.skipif(not (cpu_kernel_available() and bf16_available() and panels_wanted(torch.bfloat16)),
                                 reason="needs AVX512-BF16 without AMX (the bf16 panel kernels)")]

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "granite_moe")


def _tiny(family: str, out: Path) -> Path:
    hf = write_tiny(family, out, seed=0, vocab_size=49152)
    src = converted_dir(embedded_gguf_path())
    shutil.copy(src / "tokenizer.json", hf / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return hf


def _caches(model, dtype: torch.dtype) -> list:
    return allocate_kv_caches(model.kv_cache_specs(), MAX_BLOCKS, BLOCK, dtype, torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_step_follows_the_module_path(family, tmp_path):
    hf = _tiny(family, tmp_path / family)
    bf16 = LLM(str(hf), num_kv_blocks=32, dtype="bfloat16").engine.model
    f32 = LLM(str(hf), num_kv_blocks=32, dtype="float32").engine.model
    ids, n = prompt(28, seed=3, vocab=49152), 20
    fast, slow, ref = _caches(bf16, torch.bfloat16), _caches(bf16, torch.bfloat16), _caches(f32, torch.float32)
    for model, kv in ((bf16, fast), (bf16, slow), (f32, ref)):
        run(model, ids[:n], [0], [n], kv)  # the prompt through the modules
    apart, err, module_err = [], 0.0, 0.0
    for t in range(n, len(ids)):
        x = ids[t:t + 1]
        got = run(bf16, x, [t], [1], fast)
        assert bf16.decode_fast_path._plan is not None  # the C step ran
        hook = bf16.norm.register_forward_hook(lambda *a: None)  # a hook: the module path
        try:
            module = run(bf16, x, [t], [1], slow)
        finally:
            hook.remove()
        want = run(f32, x, [t], [1], ref)
        apart.append((got - module).abs().max().item())
        err += (got - want).abs().max().item()
        module_err += (module - want).abs().max().item()
    print(f"{family}: C step vs module path {sorted(apart)}; from float32 {err:.3f} vs {module_err:.3f}")
    # bf16 rounding apart (measured 2e-3 to 3e-2 on logits of 1-4; a routing flip in one path moves a
    # step by ~0.3, so the median), and no further from float32 than the module path, with slack
    assert sorted(apart)[len(apart) // 2] < 0.05
    assert err <= 1.1 * module_err
