"""Write an MoE checkpoint with a real model's shapes and seeded random weights (no hub download):
an HF directory (config.json from HF's own config class, bf16 safetensors under the names HF and
vLLM load, SmolLM2's tokenizer and chat template) and, with llama.cpp's own converter, a bf16
GGUF of the same tensors for llama-server.

Preset `granite-1b-a400m`: IBM Granite-3.0-1B-A400M's shapes (24 layers, hidden 1024, 16 heads /
8 KV heads, 32 experts of width 512, top-8, its four multipliers), 1.33B parameters, 0.43B active;
vocabulary 49152 (SmolLM2's tokenizer) instead of Granite's 49155.

`--skew F`: routing of random weights is near-uniform, so a skewed variant biases the routers so
that each of a tenth of the experts (3 of 32, all on EP rank 0) receives about F of the tokens
(uniform top-8 routing gives each expert 8/32 = 0.25; 0.5 makes them twice as loaded): every embedding row gets a shared direction c, and the hot experts' router rows get
alpha * c; alpha is found by bisection on the model's own measured routing (engine, load counters).

    .venv/bin/python loadtest/moe_checkpoint.py --out /work/peers/granite-moe [--skew 0.5] [--no-gguf]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

PRESETS = {
    "granite-1b-a400m": dict(
        vocab_size=49152, hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8, max_position_embeddings=4096,
        rms_norm_eps=1e-6, embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
        logits_scaling=6.0, tie_word_embeddings=True, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
        pad_token_id=2),
}
HOT_FRACTION = 10  # the skewed variant's hot experts: the first num_experts // HOT_FRACTION


def _tensors(cfg: dict, seed: int, shared: torch.Tensor | None, alpha: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    std, h, inter, e = cfg["initializer_range"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def rand(*shape: int) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    embed = std * torch.randn(cfg["vocab_size"], h, generator=g)
    if shared is not None:
        embed += shared
    out = {"model.embed_tokens.weight": embed.to(torch.bfloat16), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        router = std * torch.randn(e, h, generator=g)
        if shared is not None:
            router[: e // HOT_FRACTION] += alpha * shared / shared.norm()
        out |= {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "block_sparse_moe.router.layer.weight": router.to(torch.bfloat16),
            p + "block_sparse_moe.input_linear.weight": rand(e, 2 * inter, h),
            p + "block_sparse_moe.output_linear.weight": rand(e, h, inter),
        }
    return out


def write_hf(out: Path, preset: str, seed: int, shared: torch.Tensor | None = None, alpha: float = 0.0) -> Path:
    from transformers import GraniteMoeConfig

    from moebus.engine.loader.gguf_cache import converted_dir
    from moebus.text.gguf import embedded_gguf_path

    cfg = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    config = GraniteMoeConfig(**cfg)
    config.architectures = ["GraniteMoeForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    save_file(_tensors(cfg, seed, shared, alpha), str(out / "model.safetensors"), metadata={"format": "pt"})
    src = converted_dir(embedded_gguf_path())
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg |= {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


def hot_share(path: Path, prompts: int = 8, length: int = 64) -> float:
    """Share of the tokens that each hot expert receives, on average over them and every layer (with
    top-k routing a uniform router gives each expert k / E of the tokens)."""
    from moebus.engine.llm import LLM
    from moebus.engine.models.moe import enable_expert_load_counting
    from moebus.engine.sampling import SamplingParams

    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    counters = enable_expert_load_counting(llm.engine.model)
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(100, 49000, (length,), generator=g).tolist() for _ in range(prompts)]
    llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=1))
    loads = torch.stack(counters).sum(0).float()
    tokens = loads.sum() / llm.engine.model.args.num_experts_per_tok
    return float(loads[: len(loads) // HOT_FRACTION].mean() / tokens)


def write_skewed(out: Path, preset: str, seed: int, target: float) -> tuple[float, float]:
    """Bisection on alpha until the measured hot share is within 0.03 of target: (alpha, share)."""
    cfg = PRESETS[preset]
    g = torch.Generator().manual_seed(seed + 1)
    direction = torch.randn(cfg["hidden_size"], generator=g)
    # As strong as a token's own embedding (norm std * sqrt(H)): every residual stream carries it.
    shared = direction / direction.norm() * cfg["initializer_range"] * cfg["hidden_size"] ** 0.5
    lo, hi, share = 0.0, 4.0, 0.0
    for _ in range(8):
        alpha = (lo + hi) / 2
        share = hot_share(write_hf(out, preset, seed, shared, alpha))
        print(f"alpha {alpha:.3f}: each hot expert receives {share:.1%} of the tokens")
        if abs(share - target) < 0.03:
            break
        lo, hi = (alpha, hi) if share < target else (lo, alpha)
    return alpha, share


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="granite-1b-a400m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skew", type=float, default=None, help="share of the tokens each of the hot tenth of experts receives")
    ap.add_argument("--no-gguf", action="store_true", help="skip the bf16 GGUF (llama.cpp's converter)")
    args = ap.parse_args(argv)
    if args.skew is None:
        write_hf(args.out, args.preset, args.seed)
    else:
        alpha, share = write_skewed(args.out, args.preset, args.seed, args.skew)
        (args.out / "skew.json").write_text(json.dumps({"alpha": alpha, "hot_share": share,
                                                        "hot_experts": PRESETS[args.preset]["num_local_experts"] // HOT_FRACTION}))
    print("wrote", args.out)
    if not args.no_gguf:
        from moebus.loadtest.llamacpp_convert import convert

        print("wrote", convert(args.out, args.out.with_suffix(".bf16.gguf"), "bf16"))


if __name__ == "__main__":
    main()
