"""weight_format="gguf": SmolLM2's Q4_1 linear layers and its Q8_0 tied LM head served from the GGUF's
blocks (engine.cpu_linear.QuantLinear) against the same model dequantized to float32. The weights
are the same numbers, so only summation order differs: logits within LOGIT_ATOL and greedy output
identical on the parity prompts."""
import pytest
import torch

from moebus.engine.attention import AttentionMetadata
from moebus.engine.cpu_linear import QuantLinear
from moebus.engine.llm import LLM
from moebus.engine.model_runner import allocate_kv_caches
from moebus.engine.models import load_model
from moebus.engine.sampling import SamplingParams

# Largest |logit| of SmolLM2 on these prompts is ~30; float32 sums over K <= 1536 in two orders
# differ by ~1e-5 per layer and that grows through 30 layers: measured max 1.2e-4 (Zen 3, AVX2).
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def gguf_llm(smol_dir) -> LLM:
    return LLM(max_num_batched_tokens=512, weight_format="gguf")


@pytest.fixture(scope="module")
def dense_llm(llm) -> LLM:
    assert llm.engine.config.weight_format == "dense"  # the default
    return llm


def _all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    eng = llm.engine
    bs = eng.config.block_size
    caches = allocate_kv_caches(eng.model.kv_cache_specs(), 8, bs, torch.float32, torch.device("cpu"))
    blocks = list(range(-(-len(ids) // bs)))
    meta = AttentionMetadata([0, len(ids)], [len(ids)],
                             torch.tensor([blocks[p // bs] * bs + p % bs for p in range(len(ids))]),
                             torch.tensor([blocks], dtype=torch.int32), torch.tensor([len(ids)], dtype=torch.int32), bs)
    with torch.no_grad():
        return eng.model.compute_logits(eng.model(torch.tensor(ids), torch.arange(len(ids)), meta, caches))


def test_gguf_format_serves_the_blocks(gguf_llm, dense_llm):
    model = gguf_llm.engine.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.qtype == "Q4_1"
    assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.qtype == "Q8_0"  # the tied head runs on the embedding's own blocks
    linear_bytes = sum(m.qweight.numel() for m in model.modules() if isinstance(m, QuantLinear))
    dense_bytes = sum(p.numel() * 4 for n, p in dense_llm.engine.model.named_parameters() if "norm" not in n)
    assert linear_bytes < dense_bytes / 5  # ~96 MB of blocks vs ~540 MB of float32


def test_logits_match_the_dequantized_model(gguf_llm, dense_llm, chat_prompts):
    ids = chat_prompts[1]
    ours, ref = _all_logits(gguf_llm, ids), _all_logits(dense_llm, ids)
    diff = (ours - ref).abs().max().item()
    print(f"max abs logit diff gguf vs dense over {len(ids)} positions: {diff:.2e}")
    assert diff < LOGIT_ATOL
    assert ours.abs().max() > 5  # real logits, not zeros


def test_greedy_output_identical_to_the_dequantized_model(gguf_llm, dense_llm, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ours = [o.outputs[0].token_ids for o in gguf_llm.generate(chat_prompts, params)]
    ref = [o.outputs[0].token_ids for o in dense_llm.generate(chat_prompts, params)]
    assert ours == ref
    # batch 1: every step on the direct kernel path (the batch above prefills on the tiled one)
    assert gguf_llm.generate([chat_prompts[0]], params)[0].outputs[0].token_ids == ref[0]


def test_bad_weight_format_is_refused(smol_dir):
    with pytest.raises(ValueError, match="weight_format"):
        load_model("smollm2", weight_format="int3")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(smol_dir, weight_format="gguf")
