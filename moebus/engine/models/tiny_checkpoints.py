"""Tiny random checkpoints of the MoE families, written by HF transformers' own model classes.

`write_tiny(family, out_dir, seed, **overrides)` builds the family's HF config class with tiny
shapes, initialises the HF model under a fixed seed, randomises every tensor HF initialises to a
constant (norm gains, biases: a trained checkpoint has real values there, and a parity test must
exercise them), and calls `save_pretrained`, so the folder holds exactly what a user's
checkpoint of that family holds. A word-level tokenizer.json (token i spells `<i>`) beside it
lets the whole serving stack run on the folder.

CLI: `python -m moebus.engine.models.tiny_checkpoints --family qwen3_moe --out DIR [--seed N]`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

_MLA = dict(intermediate_size=96, moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.5)
# family -> (HF config class, HF model class, tiny config kwargs)
_TINY: dict[str, tuple[str, str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        intermediate_size=96, mlp_only_layers=[1], decoder_sparse_step=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=1.0)),
    "granite_moe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
        attention_multiplier=0.015625 * 4, residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True)),
    # MLA: 3 layers (first dense), group-limited routing; V2 with norm_topk_prob False, since HF's V2
    # router ignores the flag while the original DeepSeek code (and ours) applies it.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _MLA, q_lora_rank=None, norm_topk_prob=False, topk_method="group_limited_greedy", num_key_value_heads=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _MLA, q_lora_rank=48, norm_topk_prob=True, num_nextn_predict_layers=0, num_key_value_heads=4)),
}
FAMILIES = tuple(_TINY)
_SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.1)  # wide logits: greedy is no coin toss


def tiny_config(family: str, **overrides: object) -> dict:
    if family not in _TINY:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    return {**_SHAPE, **_TINY[family][2], **overrides}


@torch.no_grad()
def _randomise_constants(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            base = t.flatten()[0].item()
            t.copy_(base + 0.1 * torch.randn(t.shape, generator=g))


def write_tiny(family: str, out_dir: str | Path, seed: int = 0, **overrides: object) -> Path:
    import transformers  # only the writer needs HF

    config_cls, model_cls, _ = _TINY.get(family, (None, None, None))
    cfg = tiny_config(family, **overrides)
    config = getattr(transformers, config_cls)(**cfg)
    with torch.random.fork_rng(devices=[]):  # seed HF's init without touching the caller's RNG
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).eval()
    _randomise_constants(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    write_word_tokenizer(out, int(cfg["vocab_size"]))
    return out


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """tokenizer.json where token i spells `<i>` (whitespace-split words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.save(str(out_dir / "tokenizer.json"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random MoE checkpoint with HF's own classes.")
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny(args.family, args.out, args.seed))


if __name__ == "__main__":
    main()
