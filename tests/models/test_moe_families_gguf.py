"""MoE families from GGUF files written by llama.cpp's own converter: the same logits as the HF
checkpoint they came from (a bf16 file: the checkpoint's weights rounded to bf16), and
the serving engine's greedy tokens equal between the two."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.loader.gguf_cache import converted_dir
from moebus.engine.models import load_model
from moebus.engine.models.tiny_checkpoints import write_tiny
from moebus.engine.sampling import SamplingParams
from moebus.loadtest.llamacpp_convert import convert
from moebus.text.gguf import embedded_gguf_path

from .paged_steps import caches, prompt, run

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

# llama.cpp's converters keep no dense layers in qwen3moe, drop OLMoE's clip_qkv and write OLMoE's
# RMSNorm eps as 1e-5 whatever the config says, and marks DeepSeek-V3's sigmoid gating only from a
# `scoring_func` in config.json (as V3's release has; HF's config class does not save one): the tiny
# checkpoints here are built to match.
_GGUF_SAFE = {"qwen3_moe": {"mlp_only_layers": []}, "olmoe": {"clip_qkv": None, "rms_norm_eps": 1e-5},
              "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}


# Every family llama.cpp converts (loader/gguf_archs.py): not DeepSeek-V4.
GGUF_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "granite_moe", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def hf_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with SmolLM2's real tokenizer (the converter must recognise it)."""
    out = write_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=0, vocab_size=49152,
                     **_GGUF_SAFE.get(request.param, {}))
    src = converted_dir(embedded_gguf_path())
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the family's own (it would add tokens)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


@pytest.fixture(scope="module")
def gguf(hf_dir, tmp_path_factory: pytest.TempPathFactory):
    """outtype -> the converter's file of hf_dir, each converted once per module."""
    made: dict[str, Path] = {}

    def get(outtype: str) -> Path:
        if outtype not in made:
            made[outtype] = convert(hf_dir, tmp_path_factory.mktemp("gguf") / f"model-{outtype}.gguf", outtype)
        return made[outtype]
    return get


def _rounded_copy(hf_dir: Path, out: Path, dtype: torch.dtype) -> Path:
    """hf_dir with the weights llama.cpp's converter stores in dtype rounded to it (and stored back
    in float32): not the 1-D tensors (norms) nor the router, which it keeps in f32."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    state = load_file(out / "model.safetensors")
    kept = ("gate.weight", "router.layer.weight")
    save_file({k: v.to(dtype).float() if v.dim() >= 2 and not k.endswith(kept) else v for k, v in state.items()},
              out / "model.safetensors")
    return out


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_gguf_logits_match_the_hf_checkpoint(hf_dir, gguf, tmp_path, outtype):
    """A bf16 file holds the weights rounded to bf16: compared with the checkpoint rounded alike."""
    path = gguf(outtype)
    if outtype == "bf16":
        hf_dir = _rounded_copy(hf_dir, tmp_path / "rounded", torch.bfloat16)
    ours, ref = load_model(path).model, load_model(hf_dir).model
    ids = prompt(40, seed=1, vocab=49152)
    got, want = run(ours, ids, [0], [40], caches(ours, 1)), run(ref, ids, [0], [40], caches(ref, 1))
    print(f"{outtype}: max abs logit diff {(got - want).abs().max().item():.3e}")
    assert (got - want).abs().max().item() < 1e-4


def test_gguf_serves_the_same_greedy_tokens(hf_dir, gguf):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = [prompt(n, seed=n, vocab=49152).tolist() for n in (9, 33)]
    outs = [[o.outputs[0].token_ids for o in LLM(str(m), num_kv_blocks=32).generate(ps, params)]
            for m in (gguf("f32"), hf_dir)]
    assert outs[0] == outs[1]
    assert torch.tensor(outs[0]).numel() == 24
