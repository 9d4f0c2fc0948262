"""Rewrite a GGUF with its weights in Q4_K (or in a Q4_K_M-like mix with Q6_K): what tests and
benchmarks use for a k-quant file where llama.cpp's `llama-quantize` is not built. The quantizers are
plain ones (Q4_K: per 32-weight sub-block its min and range, the super-block's 6-bit scales and mins
of those; Q6_K: per 16-weight sub-block its absmax / 32, the super-block's int8 scales of those),
not llama.cpp's search; the bytes are the format's, so any reader (gguf-py's dequantize, llama.cpp,
moebus) reads the same weights. `--mix q4_k_m` puts in Q6_K what llama-quantize's Q4_K_M does: the
token embedding and output, and attn_v and the down projections (ffn_down, ffn_down_exps) of the
first and last eighth of the layers and every third between.

    python -m moebus.loadtest.kquant_file IN.gguf OUT.gguf [--mix q4_k_m] [--keep TENSOR ...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from moebus.engine.loader.kquants import Q4_K_BYTES, QK_K

Q6_K_BYTES = 210  # ql (128 bytes: low nibbles), qh (64: high 2 bits), 16 int8 scales, d (f16)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [..., k] (k a multiple of 256) -> uint8 [..., k / 256 * 144] Q4_K super-blocks."""
    lead, k = w.shape[:-1], w.shape[-1]
    x = np.asarray(w, dtype=np.float32).reshape(-1, 8, 32)  # [super-block, sub-block, weight]
    lo = np.minimum(x.min(axis=2), 0.0)  # w = scale * q - offset, offset >= 0
    scale = (x.max(axis=2) - lo) / 15.0
    offset = -lo
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(offset, dminf, out=np.zeros_like(offset), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[:, :, None]
    q = np.rint(np.divide(x + (dminf * mn)[:, :, None], step, out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    out = np.empty((x.shape[0], Q4_K_BYTES), dtype=np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk of 64: sub-block 2c in the low nibbles, 2c + 1 in the high
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return out.reshape(*lead, k // QK_K * Q4_K_BYTES)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [..., k] (k a multiple of 256) -> uint8 [..., k / 256 * 210] Q6_K super-blocks:
    w = d * sc_j * (q - 32) over 16 sub-blocks of 16, q 6 bits, sc_j int8, d f16."""
    lead, k = w.shape[:-1], w.shape[-1]
    x = np.asarray(w, dtype=np.float32).reshape(-1, 16, 16)  # [super-block, sub-block, weight]
    scale = np.abs(x).max(axis=2) / 31.0  # q - 32 in [-32, 31]
    d = (scale.max(axis=1) / 127.0).astype(np.float16)  # scale >= 0
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[:, :, None]
    q = np.rint(np.divide(x, step, out=np.zeros_like(x), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [sb, half, quarter, l]
    out = np.empty((x.shape[0], Q6_K_BYTES), dtype=np.uint8)
    # each 128-weight half: ql[l] holds quarters 0 (low nibble) and 2 (high), ql[l + 32] quarters 1
    # and 3; qh[l] the top two bits of quarters 0..3 at bits 0, 2, 4, 6 (ggml's dequantize_row_q6_K)
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out[:, 0:128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    return out.reshape(*lead, k // QK_K * Q6_K_BYTES)


def more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers, every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def target_type(name: str, shape: list[int], keep: set[str], mix: str | None,
                n_layers: int) -> GGMLQuantizationType | None:
    """The type a tensor is rewritten to (None: left as it is): weight matrices whose rows are whole
    super-blocks, in Q4_K, or under mix "q4_k_m" in Q6_K where llama-quantize's Q4_K_M puts them."""
    if len(shape) < 2 or shape[0] % QK_K or not name.endswith(".weight") or name in keep:
        return None
    if mix == "q4_k_m":
        if name in ("token_embd.weight", "output.weight"):
            return GGMLQuantizationType.Q6_K
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits(
                int(parts[1]), n_layers):
            return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def rewrite(src: Path, dst: Path, keep: set[str] = frozenset(), mix: str | None = None) -> Path:
    """dst: src's metadata and tensors, its weight matrices re-quantized to Q4_K, or to the Q4_K_M
    mix (target_type; those named in `keep` and those whose rows are not whole super-blocks as they
    were)."""
    reader, keep = GGUFReader(str(src)), set(keep)
    arch = str(reader.fields["general.architecture"].contents())
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]  # ggml order: the row length first
        if (to := target_type(t.name, shape, keep, mix, n_layers)) is not None:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(list(reversed(shape)))
            blocks = quantize_q6_k(w) if to == GGMLQuantizationType.Q6_K else quantize_q4_k(w)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=to)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape,
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--keep", action="append", default=[], help="a tensor (GGUF name) to leave as it is")
    ap.add_argument("--mix", choices=["q4_k_m"], default=None, help="Q6_K where llama-quantize's Q4_K_M puts it")
    args = ap.parse_args()
    rewrite(args.src, args.dst, set(args.keep), args.mix)
    print(args.dst)


if __name__ == "__main__":
    main()
