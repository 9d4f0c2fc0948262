"""Our SmolLM2 (from the GGUF) against HF transformers on the same weights."""
import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(smol_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    return model.eval()


def test_weights_match_hf_gguf_loader(smol_dir):
    """Our dequantize + q/k un-permute equals transformers' own GGUF loader."""
    pytest.importorskip("accelerate")
    from moebus.engine.loader.gguf_file import GGUFCheckpoint
    from moebus.text.gguf import embedded_gguf_path

    path = embedded_gguf_path()
    ours = GGUFCheckpoint.open(path).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).state_dict()
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.norm.weight"]:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


def test_prefill_logits_match_hf(llm, hf_model, chat_prompts):
    ids = chat_prompts[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
    res = llm.generate([ids], _params(max_tokens=1, logprobs=20))[0]
    top = res.outputs[0].logprobs[0]
    ref_lp = torch.log_softmax(ref, -1)
    diff = max(abs(lp - ref_lp[t].item()) for t, lp in top.items())
    print(f"max abs logprob diff vs HF over top-20: {diff:.2e}")
    assert diff < 1e-3
    assert res.outputs[0].token_ids[0] == int(ref.argmax())


def test_full_logits_match_hf(llm, hf_model, chat_prompts):
    """Every position's logits, through the paged prefill path."""
    from moebus.engine.attention import AttentionMetadata
    from moebus.engine.model_runner import allocate_kv_caches

    ids = chat_prompts[1]
    eng = llm.engine
    bs = eng.config.block_size
    # A private cache: writing into the engine's would clobber blocks its prefix cache still indexes.
    caches = allocate_kv_caches(eng.model.kv_cache_specs(), 8, bs, torch.float32, torch.device("cpu"))
    n_blocks = -(-len(ids) // bs)
    blocks = list(range(n_blocks))
    meta = AttentionMetadata([0, len(ids)], [len(ids)],
                             torch.tensor([blocks[p // bs] * bs + p % bs for p in range(len(ids))]),
                             torch.tensor([blocks], dtype=torch.int32), torch.tensor([len(ids)], dtype=torch.int32), bs)
    with torch.no_grad():
        hidden = eng.model(torch.tensor(ids), torch.arange(len(ids)), meta, caches)
        ours = eng.model.compute_logits(hidden)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"max abs logit diff vs HF over {len(ids)} positions: {diff:.2e}")
    assert diff < 2e-3


def test_greedy_32_tokens_identical_to_hf(llm, hf_model, chat_prompts):
    for ids in chat_prompts[:2]:
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32, pad_token_id=0)[0, len(ids):].tolist()
        ours = llm.generate([ids], _params(max_tokens=32, min_tokens=32))[0].outputs[0].token_ids
        assert ours == ref


def test_generate_answers_capital_of_france(llm):
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]], _params(max_tokens=30))
    assert "Paris" in out[0].outputs[0].text


def _params(**kw):
    from moebus.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, **kw)
