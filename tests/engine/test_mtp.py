"""DeepSeek-V4 MTP drafting (speculative_method="mtp"): the checkpoint's nextn layer drafts, exact
verification keeps greedy output, first drafts equal a dense HF-built reference of DeepSeek's
MTPBlock, and with weights arranged so the nextn layer predicts exactly what the target will, every
draft is accepted. Random weights: the nextn layer is unrelated to the target, so near-zero
acceptance is expected and says nothing about a trained checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebus.engine.llm import LLM
from moebus.engine.models.hf_checkpoint import MTP_OWN, write_tiny_deepseek_v4
from moebus.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

WINDOW = 16  # the tiny config's sliding window
LENGTHS = (3, 17, 40, 70)  # two prompts longer than the window, one several windows long
ENGINE = dict(tokenizer="smollm2", enable_prefix_caching=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_deepseek_v4(tmp_path_factory.mktemp("v4mtp"), seed=3, num_nextn_predict_layers=1))


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]


def generate(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(ps, params)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_checkpoint_carries_the_release_names(ckpt):
    names = set(load_file(Path(ckpt) / "mtp.safetensors"))
    assert {f"mtp.0.{n}" for n in MTP_OWN} <= names
    assert {"mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight", "mtp.0.hc_attn_fn"} <= names
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n for n in names)


def test_mtp_needs_nextn_layers(tmp_path):
    bare = write_tiny_deepseek_v4(tmp_path / "bare", seed=0)
    assert not (bare / "mtp.safetensors").exists()
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(str(bare), num_speculative_tokens=2, speculative_method="mtp", **ENGINE)


def test_greedy_output_unchanged_and_acceptance_recorded(ckpt):
    ps = prompts()
    expected = generate(LLM(ckpt, **ENGINE), ps, GREEDY)
    llm = LLM(ckpt, num_speculative_tokens=3, speculative_method="mtp", **ENGINE)
    assert generate(llm, ps, GREEDY) == expected
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens >= 3 * len(ps) * 10  # drafted (nearly) every decode step
    print(f"tiny random V4, k=3: acceptance {stats.acceptance_rate:.3f} "
          f"({stats.num_accepted}/{stats.num_draft_tokens} drafts)")


def test_prefix_cache_hits_keep_greedy_output(ckpt):
    """A hit skips the cached rows, so the drafter's window starts at the first computed one (a
    shorter window: other drafts, same verified tokens)."""
    ps = prompts(5)
    expected = generate(LLM(ckpt, **ENGINE), ps, GREEDY)
    llm = LLM(ckpt, num_speculative_tokens=2, speculative_method="mtp",
              **{**ENGINE, "enable_prefix_caching": True})
    assert generate(llm, ps, GREEDY) == expected
    drafted = llm.engine.spec_stats.num_draft_tokens
    second = llm.generate(ps, GREEDY)  # the prompts' full blocks are hits now
    assert [r.outputs[0].token_ids for r in second] == expected
    assert sum(r.num_cached_tokens for r in second) >= 16 * 6  # 17, 40 and 70 tokens: 6 full blocks
    assert llm.engine.spec_stats.num_draft_tokens > drafted


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _hf_reference(ckpt: str, tmp: Path):
    """First-draft function written from DeepSeek's MTPBlock on HF's modules: the target's streams
    (input of hc_head) over the whole sequence, mixed with the next tokens' embeddings, through an
    HF 1-layer model holding the nextn block, its hc_head/norm, and the shared head."""
    from transformers import DeepseekV4ForCausalLM

    target = DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
    main = load_file(Path(ckpt) / "model.safetensors")
    mtp = {k.removeprefix("mtp.0."): v for k, v in load_file(Path(ckpt) / "mtp.safetensors").items()}
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(cfg))
    block = {f"model.layers.0.{k}": v for k, v in mtp.items() if k not in MTP_OWN}
    block |= {"model.hc_head.hc_fn": mtp["hc_head_fn"], "model.hc_head.hc_base": mtp["hc_head_base"],
              "model.hc_head.hc_scale": mtp["hc_head_scale"], "model.norm.weight": mtp["norm.weight"],
              "head.weight": main["head.weight"], "model.embed_tokens.weight": main["model.embed_tokens.weight"]}
    save_file(block, str(tmp / "model.safetensors"))
    head = DeepseekV4ForCausalLM.from_pretrained(tmp).eval()
    eps, captured, mixed = cfg["rms_norm_eps"], {}, {}
    target.model.hc_head.register_forward_hook(lambda m, a, o: captured.update(streams=a[0]))
    head.model.layers[0].register_forward_pre_hook(lambda m, a: (mixed["x"], *a[1:]))

    @torch.no_grad()
    def first_draft(tokens: list[int]) -> int:
        target(torch.tensor([tokens[:-1]]))  # streams at positions 0..L-2
        nxt = torch.tensor([tokens[1:]])
        e = _rms(target.model.embed_tokens(nxt), mtp["enorm.weight"], eps) @ mtp["e_proj.weight"].T
        h = _rms(captured["streams"], mtp["hnorm.weight"], eps) @ mtp["h_proj.weight"].T
        mixed["x"] = e.unsqueeze(2) + h
        return int(head(nxt).logits[0, -1].argmax())

    return first_draft


def test_first_drafts_match_dense_reference(ckpt, tmp_path):
    llm = LLM(ckpt, num_speculative_tokens=2, speculative_method="mtp", **ENGINE)
    proposer, seen = llm.engine.draft_proposer, []
    propose = proposer.propose

    def spy(batch, hidden, k):
        drafts = propose(batch, hidden, k)
        seen.extend((list(t), d[0]) for t, d in zip(batch, drafts, strict=True) if d)
        return drafts

    proposer.propose = spy
    generate(llm, prompts(1)[1:], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    picks = seen[:: max(len(seen) // 8, 1)]
    assert any(len(t) - 1 > WINDOW for t, _ in picks)  # histories beyond the window are covered
    reference = _hf_reference(ckpt, tmp_path / "hf_mtp")
    assert [d for _, d in picks] == [reference(t) for t, _ in picks]


def _oracle_checkpoint(src: str, dst: Path) -> str:
    """Every block adds nothing (attention and expert output projections zero), so the streams stay
    the embedding and the target's next token is a function f of the last token alone. The nextn
    layer with e_proj = I, h_proj = 0, unit enorm and the target's final norm then computes f of its
    input token: draft 1 = f(x_L) = the target's next token, and chained drafts follow f as well."""
    import shutil

    shutil.copytree(src, dst)
    zero = ("attn.wo_b.weight", ".w2.weight")
    for name in ("model.safetensors", "mtp.safetensors"):
        t = load_file(dst / name)
        t = {k: torch.zeros_like(v) if k.endswith(zero) else v for k, v in t.items()}
        if name == "mtp.safetensors":
            h = t["mtp.0.e_proj.weight"].shape[0]
            t["mtp.0.e_proj.weight"], t["mtp.0.h_proj.weight"] = torch.eye(h), torch.zeros(h, h)
            t["mtp.0.enorm.weight"] = torch.ones(h)
            t["mtp.0.norm.weight"] = load_file(dst / "model.safetensors")["model.norm.weight"]
        save_file(t, str(dst / name))
    return str(dst)


@pytest.fixture(scope="module")
def oracle(ckpt, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _oracle_checkpoint(ckpt, tmp_path_factory.mktemp("v4mtp_oracle") / "ckpt")


def test_arranged_weights_accept_every_draft(oracle):
    ps = prompts(2)
    expected = generate(LLM(oracle, **ENGINE), ps, GREEDY)
    llm = LLM(oracle, num_speculative_tokens=3, speculative_method="mtp", **ENGINE)
    assert generate(llm, ps, GREEDY) == expected
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95
    assert llm.engine.stats_.steps < sum(len(e) for e in expected) / 2  # several tokens per step
    print(f"arranged weights, k=3: acceptance {stats.acceptance_rate:.3f}")


@pytest.mark.slow  # ~35 s: 2 x 800 requests
def test_sampled_tokens_keep_the_target_distribution(oracle):
    """Second token of 800 seeded requests (top-k 2: 4 outcomes), MTP on vs off: the arranged
    drafts are the target's argmax, accepted with probability p(argmax) and otherwise resampled from
    the residual, so both branches run. Measured: plain vs plain (other seeds) TV 0.056, plain vs MTP
    0.066; a verifier that always accepted would be ~1 - p(argmax) ~ 0.45 away."""
    prompt = prompts(4)[0]

    def second_tokens(llm: LLM) -> torch.Tensor:
        out: dict[str, list[int]] = {}
        for seed in range(800):
            out[str(seed)] = []
            params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, seed=seed, ignore_eos=True)
            llm.engine.add_request(str(seed), prompt, params)
        while llm.engine.has_unfinished_requests():
            for o in llm.engine.step():
                out[o.request_id] += o.new_token_ids
        return torch.bincount(torch.tensor([t[1] for t in out.values()]), minlength=512).float()

    plain = second_tokens(LLM(oracle, **ENGINE))
    llm = LLM(oracle, num_speculative_tokens=1, speculative_method="mtp", **ENGINE)
    spec = second_tokens(llm)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted < stats.num_draft_tokens  # accepted and rejected drafts both occur
    tv = 0.5 * (plain / plain.sum() - spec / spec.sum()).abs().sum().item()
    print(f"total variation {tv:.3f}; acceptance {stats.acceptance_rate:.2f}")
    assert tv < 0.15


def test_release_config_lists_the_nextn_layer_after_the_main_ones(ckpt):
    """V4's config.json `compress_ratios` has one entry per main layer, then the nextn layers' (0)."""
    from moebus.engine.models import load_model
    from moebus.engine.models.deepseek_v4 import DeepseekV4Args
    from moebus.engine.models.deepseek_v4_mtp import load_mtp_layers

    args = DeepseekV4Args.from_hf_config({"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0]})
    assert args.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    model = load_model(ckpt).model
    assert len(load_mtp_layers(model, {"compress_ratios": [0] * 5})) == 1
    with pytest.raises(NotImplementedError, match="compressed attention"):
        load_mtp_layers(model, {"compress_ratios": [0] * 4 + [128]})
