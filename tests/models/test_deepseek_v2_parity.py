"""Parity of our paged DeepSeek-V2 / V3 (MLA, latent KV cache) with HF's models on tiny random checkpoints.

The checkpoints (tiny_checkpoints.write_tiny, families deepseek_v2 / deepseek_v3) have 3 layers (1 dense, 2 MoE with 8
experts top-2 in 4 groups, 1 shared expert), 4 heads, latent rank 32, rope dim 8, so 40-token
prompts span three 16-token KV blocks. Variants: V3 (q LoRA, noaux_tc routing with score bias),
V2 (q_proj, group_limited_greedy), V2 with q LoRA and greedy routing, V3 with YaRN rope.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebus.engine.attention import KVCacheSpec
from moebus.engine.model_runner import kv_bytes_per_block
from moebus.engine.models import load_model
from moebus.engine.models.deepseek_v2 import DeepseekV2Args, DeepseekV2ForCausalLM
from moebus.engine.models.mla_attention import interleaved_to_neox
from moebus.engine.models.tiny_checkpoints import write_tiny

from .paged_steps import caches, greedy_vs_hf, logits_diff_vs_hf, prompt, run

TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "v3": dict(family="deepseek_v3"),
    "v2": dict(family="deepseek_v2"),
    "v2_qlora_greedy": dict(family="deepseek_v2", q_lora_rank=48, topk_method="greedy"),
    # max_position_embeddings = factor * original: HF warns when they disagree
    "v3_yarn": dict(family="deepseek_v3", rope_parameters=YARN, max_position_embeddings=2048),
}


def load_engine_model(path: Path) -> DeepseekV2ForCausalLM:
    return load_model(path).model


@pytest.fixture(scope="module", params=list(VARIANTS))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    variant = dict(VARIANTS[request.param])
    return write_tiny(variant.pop("family"), tmp_path_factory.mktemp(request.param), seed=0, **variant)


@pytest.fixture(scope="module")
def hf_model(ckpt: Path):
    import transformers

    arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # always generate every requested token
    return model


@pytest.fixture(scope="module")
def model(ckpt: Path) -> DeepseekV2ForCausalLM:
    return load_engine_model(ckpt)


def test_prefill_logits_match_hf(model, hf_model):
    assert logits_diff_vs_hf(model, hf_model, prompt(40, seed=1)) < TOL


def test_greedy_decode_matches_hf_generate(model, hf_model):
    ours, ref = greedy_vs_hf(model, hf_model, prompt(40, seed=2), 24)
    assert ours == ref


def test_chunked_prefill_matches_single_prefill(model):
    ids = prompt(40, seed=3)
    whole = run(model, ids, [0], [40], caches(model, 1))
    kv = caches(model, 1)
    first = run(model, ids[:23], [0], [23], kv)
    second = run(model, ids[23:], [23], [17], kv)  # reads the first 23 tokens' latents from the cache
    assert (torch.cat([first, second]) - whole).abs().max().item() < TOL


def test_flattened_batch_matches_each_alone(model):
    a, b = prompt(40, seed=4), prompt(27, seed=5)
    alone_a = run(model, a, [0], [40], caches(model, 1))
    alone_b = run(model, b, [0], [27], caches(model, 1))
    kv = caches(model, 2)
    both = run(model, torch.cat([a, b]), [0, 0], [40, 27], kv)
    assert (both[:40] - alone_a).abs().max().item() < TOL
    assert (both[40:] - alone_b).abs().max().item() < TOL
    # Mixed step: sequence 0 decodes one token while sequence 1 prefills 5 more from its cache;
    # then both decode in one batched decode step.
    a2, b2, c = prompt(1, seed=6), prompt(5, seed=7), prompt(2, seed=8)
    mixed = run(model, torch.cat([a2, b2]), [40, 27], [1, 5], kv)
    decode = run(model, c, [41, 32], [1, 1], kv)
    ref_a = run(model, torch.cat([a, a2, c[:1]]), [0], [42], caches(model, 1))
    ref_b = run(model, torch.cat([b, b2, c[1:]]), [0], [33], caches(model, 1))
    assert (mixed - torch.cat([ref_a[-2:-1], ref_b[-6:-1]])).abs().max().item() < TOL
    assert (decode - torch.cat([ref_a[-1:], ref_b[-1:]])).abs().max().item() < TOL


def test_cache_holds_only_the_latent(model, hf_model):
    """Per token and layer: [c_kv | k_pe] once (V is a view of K), not H heads of K and V; and the
    stored values are HF's cached latent. HF's V3 interleaved rotation already returns k_pe as
    [evens | odds] (our order); its V2 complex rotation keeps the pairs interleaved."""
    a = model.args
    r, rope = a.kv_lora_rank, a.qk_rope_head_dim
    assert model.kv_cache_specs() == [KVCacheSpec(1, r + rope, 0)] * a.num_hidden_layers
    per_token = kv_bytes_per_block(model.kv_cache_specs(), 1, torch.float32) // 4 // a.num_hidden_layers
    assert per_token == r + rope < a.num_attention_heads * (a.qk_head_dim + a.v_head_dim)
    ids = prompt(20, seed=9)
    kv = caches(model, 1)
    run(model, ids, [0], [20], kv)
    with torch.no_grad():
        hf_cache = hf_model(ids[None], use_cache=True).cache
    perm = interleaved_to_neox(rope) if a.model_type == "deepseek_v2" else torch.arange(rope)
    for (k_cache, v_cache), layer in zip(kv, hf_cache.layers, strict=True):
        assert v_cache.numel() == 0
        ours = k_cache.flatten(0, 1)[:20, 0]  # sequence 0 owns blocks 0.. in order
        assert (ours[:, :r] - layer.keys[0, 0]).abs().max().item() < 1e-5
        assert (ours[:, r:] - layer.values[0, 0][:, perm]).abs().max().item() < 1e-5


def test_reference_attention_paths_read_the_latent_view(model, monkeypatch):
    """Real heads (r + rope = 576 channels) exceed the C kernels' head-dim limits, so attention then
    runs the torch references: they must read V as the strided view of K as well."""
    from moebus.kernels import paged_attention

    ids = prompt(40, seed=10)

    def chunked_then_decode() -> torch.Tensor:
        kv = caches(model, 1)
        return torch.cat([run(model, ids[:23], [0], [23], kv), run(model, ids[23:39], [23], [16], kv),
                          run(model, ids[39:], [39], [1], kv)])

    kernels = chunked_then_decode()
    monkeypatch.setattr("moebus.platforms.cpu.platform.prefill_attention_cpu", lambda *args, **kwargs: None)
    monkeypatch.setattr(paged_attention, "paged_attention_decode_cpu", lambda *args, **kwargs: None)
    assert (chunked_then_decode() - kernels).abs().max().item() < TOL


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors went through `edit(dict)`."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.kv_b_proj.weight",
                                  "model.layers.2.mlp.experts.5.up_proj.weight",
                                  "model.layers.1.mlp.shared_experts.down_proj.weight",
                                  "model.layers.0.mlp.gate_proj.weight"])
def test_checkpoint_missing_a_tensor_fails_naming_it(ckpt, tmp_path, name):
    broken = _broken_copy(ckpt, tmp_path / "ckpt", lambda s: s.pop(name))
    with pytest.raises(KeyError, match=f"missing weight {name}"):
        load_engine_model(broken)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                                  "model.layers.2.mlp.experts.3.gate_proj.weight",
                                  "model.layers.1.mlp.shared_experts.up_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight", "model.norm.weight"])
def test_checkpoint_with_a_misshaped_tensor_fails_naming_it(ckpt, tmp_path, name):
    def reshape(state: dict[str, torch.Tensor]) -> None:
        state[name] = torch.cat([state[name], state[name][:1]])  # one row too many

    with pytest.raises(ValueError, match=f"{name}: shape"):
        load_engine_model(_broken_copy(ckpt, tmp_path / "ckpt", reshape))


def test_unexpected_tensors_fail_and_nextn_layers_are_set_aside(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(2)}  # a release's MTP layer (layer n)
    with pytest.raises(KeyError, match="unexpected weight model.layers.3.eh_proj.weight"):
        DeepseekV2ForCausalLM(DeepseekV2Args.from_hf_config(config)).load_weights({**state, **extra})
    m = DeepseekV2ForCausalLM(DeepseekV2Args.from_hf_config({**config, "num_nextn_predict_layers": 1}))
    m.load_weights({**state, **extra})
    assert list(m.mtp_weights) == list(extra)


@pytest.mark.parametrize(("patch", "field"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, r"rope_parameters\.rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_parameters\.rope_type"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantization_config"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "sqrtsoftplus"}, "scoring_func"),
])
def test_unsupported_config_fails_naming_the_field(ckpt, tmp_path, patch, field):
    broken = shutil.copytree(ckpt, tmp_path / "ckpt")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **patch}))
    with pytest.raises(ValueError, match=field):
        load_engine_model(broken)


def test_release_config_layout_reads_like_hf_layout():
    """DeepSeek's released config.json (top-level rope_theta + rope_scaling "type", topk_method,
    scoring_func, no rope_interleave) and transformers 5's rope_parameters give the same model."""
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "rope_interleave": True,
          "rope_parameters": {**YARN, "rope_theta": 50000.0}}
    release = {"architectures": ["DeepseekV3ForCausalLM"], "rope_theta": 50000.0, "topk_method": "noaux_tc",
               "scoring_func": "sigmoid", "rope_scaling": {**{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")},
                                                           "type": "yarn"}}
    a, b = DeepseekV2Args.from_hf_config(hf), DeepseekV2Args.from_hf_config(release)
    assert a.rope() == b.rope() and a.softmax_scale == b.softmax_scale and a.rope().theta == 50000.0
    v2 = DeepseekV2Args.from_hf_config({"architectures": ["DeepseekV2ForCausalLM"], "rope_interleave": False})
    assert (v2.model_type, v2.scoring_func, v2.topk_method, v2.rope_interleave) == (
        "deepseek_v2", "softmax", "greedy", True)


def test_yarn_matches_hf_rope_init():
    """inv_freq and the attention factor HF infers from mscale / mscale_all_dim (unequal here), and
    the softmax scale's mscale^2."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    rope = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}
    cfg = DeepseekV3Config(qk_rope_head_dim=8, qk_nope_head_dim=16, max_position_embeddings=2048, rope_parameters=rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = DeepseekV2Args.from_hf_config(cfg.to_dict())
    assert torch.allclose(ours.rope().inv_freq(8), inv_freq) and ours.rope().attention_factor == pytest.approx(factor)
    assert ours.softmax_scale == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, 24 ** -0.5))
