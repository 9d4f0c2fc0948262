"""Build an Idefics3Encoder from an HF checkpoint folder or from a llama.cpp mmproj GGUF.

Folder: config.json (Idefics3 / SmolVLM), *.safetensors (`model.vision_model.*`, `model.connector.*`;
the text model beside them is the engine's business), preprocessor_config.json when present.
mmproj GGUF: general.architecture "clip", projector type "idefics3", tensors named by the `gguf`
package (`v.blk.N.attn_q`, `mm.model.fc`, ...), hyper-parameters under `clip.vision.*`. It knows
nothing of the text vocabulary, so the `<image>` token id comes from the caller.

The encoder's name (folded into every image's content hash) digests the weights, the settings and
the compute dtype: equal names mean equal embeddings, whatever file they came from.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from moebus.engine.loader.gguf_file import GGUFCheckpoint
from moebus.engine.vision.idefics3 import Idefics3Args, Idefics3Encoder, Idefics3VisionModel, ImagePreprocess
from moebus.engine.vision.siglip import SiglipArgs

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")

_T = gguf.MODEL_TENSOR
_GGUF_TOP = {  # mmproj tensor -> our module (HF name minus `model.`)
    _T.V_ENC_EMBD_PATCH: "vision_model.embeddings.patch_embedding",
    _T.V_ENC_EMBD_POS: "vision_model.embeddings.position_embedding",
    _T.V_POST_NORM: "vision_model.post_layernorm",
    _T.V_MMPROJ_FC: "connector.modality_projection.proj",
}
_GGUF_LAYER = {
    _T.V_ENC_ATTN_Q: "self_attn.q_proj", _T.V_ENC_ATTN_K: "self_attn.k_proj", _T.V_ENC_ATTN_V: "self_attn.v_proj",
    _T.V_ENC_ATTN_O: "self_attn.out_proj", _T.V_ENC_INPUT_NORM: "layer_norm1",
    _T.V_ENC_POST_ATTN_NORM: "layer_norm2", _T.V_ENC_FFN_UP: "mlp.fc1", _T.V_ENC_FFN_DOWN: "mlp.fc2",
}


def load_encoder(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          image_token_id: int | None = None) -> Idefics3Encoder:
    """path: a checkpoint folder or an mmproj .gguf file. image_token_id: required for a GGUF (the
    `<image>` id of the language model's tokenizer); for a folder it overrides config.json's."""
    path = Path(path)
    if path.suffix == ".gguf":
        if image_token_id is None:
            raise ValueError("an mmproj GGUF does not name the <image> token: pass image_token_id")
        args, pre, state = _read_mmproj(path, image_token_id)
    else:
        args, pre, state = _read_folder(path, image_token_id)
    with torch.device("meta"):  # every weight comes from the file
        model = Idefics3VisionModel(args)
    model = model.to_empty(device=device)
    model.load_weights(state)
    model = model.to(dtype)
    return Idefics3Encoder(model, pre, _name(args, pre, state, dtype))


def _read_folder(path: Path, image_token_id: int | None) -> tuple[Idefics3Args, ImagePreprocess, dict]:
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: expected an Idefics3 checkpoint folder (config.json) or an mmproj .gguf")
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not one of {ARCHITECTURES}")
    args = Idefics3Args.from_hf_config(cfg)
    if image_token_id is not None:
        args.image_token_id = image_token_id
    pre_file = path / "preprocessor_config.json"
    pre = ImagePreprocess.from_hf(json.loads(pre_file.read_text()) if pre_file.exists() else {},
                                  args.vision.image_size)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:  # read only the vision tensors, not the text model
            for key in sf.keys():
                if key.startswith(_VISION_PREFIXES):
                    state[key.removeprefix("model.")] = sf.get_tensor(key).float()
    if not state:
        raise FileNotFoundError(f"{path}: no model.vision_model.* / model.connector.* tensors in *.safetensors")
    return args, pre, state


def _read_mmproj(path: Path, image_token_id: int) -> tuple[Idefics3Args, ImagePreprocess, dict]:
    ck = GGUFCheckpoint.open(path)
    meta = ck.metadata
    K, V = gguf.Keys.Clip, gguf.Keys.ClipVision
    projector = meta.get(V.PROJECTOR_TYPE, meta.get(K.PROJECTOR_TYPE))
    if meta.get("general.architecture") != "clip" or projector != gguf.VisionProjectorType.IDEFICS3:
        raise ValueError(f"{path}: not an idefics3 mmproj (architecture {meta.get('general.architecture')!r}, "
                         f"projector {projector!r})")
    if meta.get(V.USE_SILU):
        raise ValueError(f"{path}: SiLU vision MLP is not Idefics3's")
    vision = SiglipArgs(
        hidden_size=int(meta[V.EMBEDDING_LENGTH]), intermediate_size=int(meta[V.FEED_FORWARD_LENGTH]),
        num_hidden_layers=int(meta[V.BLOCK_COUNT]), num_attention_heads=int(meta[V.Attention.HEAD_COUNT]),
        image_size=int(meta[V.IMAGE_SIZE]), patch_size=int(meta[V.PATCH_SIZE]),
        layer_norm_eps=float(meta[V.Attention.LAYERNORM_EPS]),
        hidden_act="gelu_pytorch_tanh")  # clip.cpp's GELU is the tanh approximation
    args = Idefics3Args(vision, int(meta[V.PROJECTION_DIM]), image_token_id,
                        int(meta.get(V.Projector.SCALE_FACTOR, 2)))
    pre = ImagePreprocess(vision.image_size, _opt_int(meta.get(V.PREPROC_IMAGE_SIZE)),
                          image_mean=tuple(float(x) for x in meta.get(V.IMAGE_MEAN, (0.5,) * 3)),
                          image_std=tuple(float(x) for x in meta.get(V.IMAGE_STD, (0.5,) * 3)))
    names = _gguf_names(vision.num_hidden_layers)
    state = {}
    for t in ck.reader.tensors:
        if t.name not in names:
            raise KeyError(f"{path}: unexpected mmproj tensor {t.name}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        state[names[t.name]] = torch.from_numpy(w.reshape([int(x) for x in reversed(t.shape)]).copy())
    return args, pre, state


def _gguf_names(num_layers: int) -> dict[str, str]:
    """mmproj tensor name -> our state-dict key, for weights and biases."""
    out = {}
    for kind, ours in _GGUF_TOP.items():
        out[gguf.TENSOR_NAMES[kind]] = ours
    for i in range(num_layers):
        for kind, ours in _GGUF_LAYER.items():
            out[gguf.TENSOR_NAMES[kind].format(bid=i)] = f"vision_model.encoder.layers.{i}.{ours}"
    return {f"{g}.{s}": f"{o}.{s}" for g, o in out.items() for s in ("weight", "bias")}


def _opt_int(v: object) -> int | None:
    return None if v is None else int(v)


def _name(args: Idefics3Args, pre: ImagePreprocess, state: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((args, pre, dtype)).encode())
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].float().contiguous().numpy().tobytes())
    return f"idefics3-{h.hexdigest()}"
