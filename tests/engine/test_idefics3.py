"""Idefics3 / SmolVLM image encoder against HF transformers, on a tiny random checkpoint.

The checkpoint is HF's own Idefics3ForConditionalGeneration (seeded, norms randomised), saved with
save_pretrained next to an Idefics3ImageProcessorPil config and a word-level tokenizer that knows
the image tokens, so HF's processor, HF's model, our encoder and our engine all read the same files.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

IMAGE_ID, FAKE_ID, GLOBAL_ID = 101, 100, 102
VOCAB = 128


def _tiny_config():
    return transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=48, patch_size=8),  # 6 x 6 patches -> 3 x 3 = 9 image tokens
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rope_theta=50000.0, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        scale_factor=2, image_token_id=IMAGE_ID)


def _hf_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    specials = {FAKE_ID: "<fake_token_around_image>", IMAGE_ID: "<image>", GLOBAL_ID: "<global-img>",
                103: "<end_of_utterance>"}
    for i, tok in specials.items():
        del vocab[f"w{i}"]
        vocab[tok] = i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w3", pad_token="w0")


@torch.no_grad()
def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """HF starts norms at 1 / 0; random ones make the parity check see every gain and bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint folder, HF model in float32, HF processor)."""
    path = tmp_path_factory.mktemp("tiny_idefics3")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.Idefics3ForConditionalGeneration(_tiny_config()).eval()
    _randomise_norms(hf, 1)
    hf.save_pretrained(path)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = Idefics3ImageProcessorPil(max_image_size={"longest_edge": 48}, size={"longest_edge": 96},
                                       image_mean=[0.4, 0.5, 0.6], image_std=[0.3, 0.5, 0.7])
    images.save_pretrained(path)
    tok = _hf_tokenizer()
    tok.save_pretrained(path)
    processor = transformers.Idefics3Processor(images, tok, image_seq_len=9)
    return path, hf, processor


def _image(seed: int, size: tuple[int, int] = (53, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _encoder(path, dtype=torch.float32, **kw):
    from moebus.engine.vision.idefics3_load import load_encoder

    return load_encoder(path, dtype=dtype, **kw)


def test_satisfies_the_image_encoder_protocol(tiny):
    from moebus.engine.vision.base import ImageEncoder

    enc: ImageEncoder = _encoder(tiny[0])
    assert enc.hidden_size == 64 and enc.num_tokens(_image(0)) == 9
    assert enc.name.startswith("idefics3-") and enc.name != _encoder(tiny[0], torch.float64).name


def test_preprocess_matches_hf_processor_without_splitting(tiny):
    path, _, processor = tiny
    enc = _encoder(path)
    for seed, size in [(0, (53, 37)), (1, (30, 70)), (2, (48, 48))]:
        img = _image(seed, size)
        ref = processor.image_processor(images=[img], do_image_splitting=False, return_tensors="pt")
        torch.testing.assert_close(enc.preprocess(img), ref["pixel_values"][0, 0], atol=1e-6, rtol=0)


def test_prompt_form_matches_hf_processor(tiny):
    path, _, processor = tiny
    enc = _encoder(path)
    form = enc.prompt_form()
    img = _image(0)
    ref = processor(text="w5 <image> w6", images=[img], do_image_splitting=False)["input_ids"][0]
    tok = processor.tokenizer
    ours = (tok.encode("w5", add_special_tokens=False) + tok.encode(form.prefix, add_special_tokens=False)
            + [form.placeholder_token_id] * enc.num_tokens(img) + tok.encode(form.suffix, add_special_tokens=False)
            + tok.encode("w6", add_special_tokens=False))
    assert ours == ref
    assert ref[1:4] == [FAKE_ID, GLOBAL_ID, IMAGE_ID]


def test_image_features_match_hf_fp32_and_fp64(tiny):
    path, hf, _ = tiny
    pixels = torch.randn(3, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref32 = hf.get_image_features(pixels[None]).pooler_output[0].view(3, 9, 64)
        ref64 = copy.deepcopy(hf).double().get_image_features(pixels[None].double()).pooler_output[0].view(3, 9, 64)
    ours32 = torch.stack(_encoder(path).encode(list(pixels)))
    ours64 = torch.stack(_encoder(path, torch.float64).encode(list(pixels.double())))
    assert ours32.dtype == torch.float32 and ours64.dtype == torch.float64
    torch.testing.assert_close(ours64, ref64, atol=1e-12, rtol=1e-12)
    err32, hf_err32 = (ours32.double() - ref64).abs().max().item(), (ref32.double() - ref64).abs().max().item()
    print(f"fp32 vs fp64 max abs error: ours {err32:.2e}, HF {hf_err32:.2e}")
    assert err32 <= max(4 * hf_err32, 1e-6)
    torch.testing.assert_close(ours32, ref32, atol=1e-5, rtol=1e-5)


def test_engine_logits_and_greedy_tokens_match_hf(tiny):
    from moebus.engine.config import EngineConfig
    from moebus.engine.llm_engine import LLMEngine
    from moebus.engine.multimodal import ImageSpan
    from moebus.engine.sampling import SamplingParams
    from moebus.text.tokenizer import tokenizer_from_hf_dir

    path, hf, processor = tiny
    img = _image(4, (64, 40))
    inputs = processor(text="w5 w6 w7 <image> w8 w9", images=[img], do_image_splitting=False, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    new = 8
    with torch.no_grad():
        ref_logits = hf(**inputs).logits[0, -1]
        ref_tokens = hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()

    enc = _encoder(path)
    span = ImageSpan(ids.index(IMAGE_ID), enc.encode([enc.preprocess(img)])[0], content_hash=1234)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, max_model_len=128),
                       tokenizer=tokenizer_from_hf_dir(path))
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=20)

    def run(rid: str, images: list[ImageSpan]) -> tuple[list[int], dict[int, float]]:
        engine.add_request(rid, ids, params, images=images)
        toks, lps = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                toks += out.new_token_ids
                lps += out.logprobs or []
        return toks, lps[0]

    tokens, first = run("with-image", [span])
    ref_lp = torch.log_softmax(ref_logits.double(), -1)
    diff = max(abs(lp - ref_lp[t].item()) for t, lp in first.items())
    print(f"max abs logprob diff vs HF over the top-20 at the prompt's last position: {diff:.2e}")
    assert diff < 1e-4
    assert tokens == ref_tokens
    _, blind = run("placeholders-only", [])  # the image must matter, or the check above proves little
    assert max(abs(lp - ref_lp[t].item()) for t, lp in blind.items() if t in first) > 1e-2


def _write_mmproj(hf_dir, out, qtype: str = "F32"):
    """What llama.cpp's converter writes for SmolVLM: gguf's own HF -> mmproj tensor names, clip.* keys."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    pre = json.loads((hf_dir / "preprocessor_config.json").read_text())
    v = cfg["vision_config"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    w.add_vision_projection_dim(cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(v["image_size"])
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v["num_hidden_layers"])
    w.add_vision_head_count(v["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_vision_attention_layernorm_eps(v["layer_norm_eps"])
    w.add_vision_projector_scale_factor(cfg["scale_factor"])
    w.add_vision_use_gelu(True)
    w.add_vision_preproc_image_size(pre["size"]["longest_edge"])
    for key, t in load_file(str(hf_dir / "model.safetensors")).items():
        if key.startswith(("model.vision_model.", "model.connector.")):
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            assert name is not None, key
            arr = t.numpy().astype(np.float32)
            if qtype == "F32" or ".embeddings." in key or t.dim() == 1:  # the converter keeps these F32
                w.add_tensor(name, arr)
            else:
                kind = gguf.GGMLQuantizationType[qtype]
                w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_mmproj_gguf_round_trip(tiny, tmp_path, qtype):
    path, _, _ = tiny
    mmproj = _write_mmproj(path, tmp_path / "mmproj.gguf", qtype)
    with pytest.raises(ValueError, match="image_token_id"):
        _encoder(mmproj)
    ours, theirs = _encoder(path), _encoder(mmproj, image_token_id=IMAGE_ID)
    assert theirs.prompt_form() == ours.prompt_form() and theirs.hidden_size == ours.hidden_size
    img = _image(5)
    torch.testing.assert_close(theirs.preprocess(img), ours.preprocess(img), atol=1e-6, rtol=0)
    a, b = ours.encode([ours.preprocess(img)])[0], theirs.encode([theirs.preprocess(img)])[0]
    if qtype == "F32":
        assert torch.equal(a, b)
    else:  # rounded matrices: close, not equal
        torch.testing.assert_close(b, a, atol=2e-2, rtol=0)
