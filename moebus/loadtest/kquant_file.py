"""Rewrite a GGUF with its weights in Q4_K: what tests and benchmarks use for a k-quant file where
llama.cpp's `llama-quantize` is not built. The quantizer is a plain one (per 32-weight sub-block its
min and range, the super-block's 6-bit scales and mins of those), not llama.cpp's search; the bytes
are the format's, so any reader (gguf-py's dequantize, llama.cpp, moebus) reads the same weights.

    python -m moebus.loadtest.kquant_file IN.gguf OUT.gguf [--keep TENSOR ...]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from moebus.engine.loader.kquants import Q4_K_BYTES, QK_K


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


def _rewritten(name: str, shape: list[int], keep: set[str]) -> bool:
    """Which tensors become Q4_K: the weight matrices whose rows are whole super-blocks."""
    return len(shape) >= 2 and shape[0] % QK_K == 0 and name.endswith(".weight") and name not in keep


def rewrite(src: Path, dst: Path, keep: set[str] = frozenset()) -> Path:
    """dst: src's metadata and tensors, its weight matrices re-quantized to Q4_K (those named in
    `keep` and those whose rows are not whole super-blocks as they were)."""
    reader, keep = GGUFReader(str(src)), set(keep)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]  # ggml order: the row length first
        if _rewritten(t.name, shape, keep):
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(list(reversed(shape)))
            blocks = quantize_q4_k(w)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q4_K)
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
    args = ap.parse_args()
    rewrite(args.src, args.dst, set(args.keep))
    print(args.dst)


if __name__ == "__main__":
    main()
