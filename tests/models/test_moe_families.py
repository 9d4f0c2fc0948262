"""Qwen3-MoE, Mixtral, OLMoE and GraniteMoE against HF transformers fp32 on tiny random checkpoints
written by HF's own classes (models/tiny_checkpoints.py): logits within 1e-4, greedy decode equal
to HF generate, chunked and batched prefill equal to alone; broken checkpoints fail at load naming
the tensor or config field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebus.engine.models import load_model
from moebus.engine.models.tiny_checkpoints import FAMILIES, write_tiny

from .paged_steps import caches, greedy_vs_hf, logits_diff_vs_hf, prompt, run

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=0)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # always the full count of tokens
    return model


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt).model


def test_prefill_logits_match_hf(model, hf_model):
    assert logits_diff_vs_hf(model, hf_model, prompt(40, seed=1)) < TOL


def test_logits_are_wide_enough_that_greedy_is_no_coin_toss(hf_model):
    with torch.no_grad():
        assert hf_model(prompt(40, seed=1)[None]).logits.abs().max().item() > 0.5


def test_greedy_decode_matches_hf_generate(model, hf_model):
    ours, ref = greedy_vs_hf(model, hf_model, prompt(33, seed=2), 24)
    assert ours == ref


def test_chunked_and_batched_prefill_match_one_prefill(model):
    a, b = prompt(40, seed=3), prompt(27, seed=4)
    whole_a = run(model, a, [0], [40], caches(model, 1))
    whole_b = run(model, b, [0], [27], caches(model, 1))
    kv = caches(model, 1)
    chunked = torch.cat([run(model, a[:23], [0], [23], kv), run(model, a[23:], [23], [17], kv)])
    assert (chunked - whole_a).abs().max().item() < TOL
    both = run(model, torch.cat([a, b]), [0, 0], [40, 27], caches(model, 2))
    assert (both - torch.cat([whole_a, whole_b])).abs().max().item() < TOL


def _copy(ckpt: Path, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path / "ckpt"
    shutil.copytree(ckpt, out)
    return out, load_file(out / "model.safetensors")


def test_a_missing_expert_tensor_fails_naming_it(ckpt, tmp_path):
    out, state = _copy(ckpt, tmp_path)
    victim = next(k for k in sorted(state) if ".experts." in k or "input_linear" in k)
    del state[victim]
    save_file(state, out / "model.safetensors")
    with pytest.raises(KeyError, match=victim.split(".experts.")[0]):
        load_model(out)


def test_a_misshaped_tensor_fails_naming_it(ckpt, tmp_path):
    out, state = _copy(ckpt, tmp_path)
    victim = "model.layers.2.self_attn.o_proj.weight"
    state[victim] = state[victim][:, :-1].contiguous()
    save_file(state, out / "model.safetensors")
    with pytest.raises((ValueError, KeyError), match="o_proj"):
        load_model(out)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_type 'longrope'"),
    ("architectures", ["FancyMoeForCausalLM"], "unsupported architecture 'FancyMoeForCausalLM'"),
])
def test_unsupported_config_fails_naming_the_field(ckpt, tmp_path, field, value, message):
    out, _ = _copy(ckpt, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg[field] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(out)
