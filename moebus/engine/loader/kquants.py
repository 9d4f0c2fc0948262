"""GGUF k-quants served on the blocks' kernels: Q4_K rewritten as Q4_1 blocks, Q6_K and Q5_K
re-quantized to Q8_0.

A Q4_K super-block (144 bytes, 256 weights) is 8 sub-blocks of 32 weights w = d * sc_j * q - dmin * m_j
(q a nibble, sc_j and m_j 6-bit integers, d and dmin f16). A Q4_1 block (20 bytes, 32 weights) is
w = d' * q + m'. So each sub-block is one Q4_1 block with d' = d * sc_j and m' = -dmin * m_j: the same
nibbles, only the two scales change form. They are stored in f16 as Q4_1's are, which rounds the
products of d (11 significant bits) and a 6-bit integer to 11 bits: a weight moves by at most 2^-11
of 15 times its sub-block's scale plus its offset (tests/engine/test_kquants.py holds it to that).
On Gaussian weights (std 0.05, 256 x 1024) that is an RMS change of 3.2e-5, against 8.3e-5 for
rounding the same Q4_K weights to bf16 and 3.9e-3 for the 4-bit quantization itself. Q4_K is the
type of most of a Q4_K_M / Q4_K_S file's weights (llama.cpp's most published quantizations).

Their other tensors (Q6_K: the embedding, half the layers' attn_v and down experts; Q5_K in the
Q5_K_* files) have 16- or 32-weight sub-blocks with 6- or 5-bit values under an 8-bit scale: no block
type the kernels take holds them exactly, so they are re-quantized to Q8_0 (`as_q8_0`: gguf-py's
dequantization, then Q8_0's absmax / 127 scale a block of 32). A weight moves by at most half a
Q8_0 step plus the f16 rounding of its scale, 1/254 + 2^-11 of its block's largest weight
(tests/engine/test_kquants.py); measured on a Q4_K_M file llama-quantize wrote (Q6_K tensors of RMS
0.020): an RMS change of 1.06e-4 and a largest of 0.0044 of the block's largest weight. The same
re-quantization joins parts served in one kernel that came in different types (`one_type`: q, k and v
of a fused projection, an expert's gate and up).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize, quantize

QK_K = 256  # weights a super-block
Q4_K_BYTES = 144  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
Q4_1_BYTES = 20  # d, m (f16), 16 bytes of nibbles
TRANSCODED = {"Q4_K": "Q4_1", "Q5_K": "Q8_0", "Q6_K": "Q8_0"}  # a GGUF type -> the block type it is served as


def q4_k_to_q4_1(data: np.ndarray) -> np.ndarray:
    """uint8 rows of Q4_K super-blocks [..., k / 256 * 144] -> the same weights as Q4_1 blocks
    [..., k / 32 * 20] (any leading dims: a 2-D weight or a 3-D expert stack)."""
    lead, nbytes = data.shape[:-1], data.shape[-1]
    if nbytes % Q4_K_BYTES:
        raise ValueError(f"a Q4_K row of {nbytes} bytes is not whole super-blocks of {Q4_K_BYTES}")
    sb = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, Q4_K_BYTES)
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(sb[:, 4:16])  # gguf-py's unpacking of the 6-bit scales and mins
    qs = sb[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles then high nibbles
    nib = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # [n, sub-block, weight]
    out = np.empty((sb.shape[0], 8, Q4_1_BYTES), dtype=np.uint8)
    out[:, :, 0:2] = (d * sc).astype(np.float16).view(np.uint8).reshape(-1, 8, 2)
    out[:, :, 2:4] = (-(dmin * mn)).astype(np.float16).view(np.uint8).reshape(-1, 8, 2)
    out[:, :, 4:] = nib[:, :, :16] | (nib[:, :, 16:] << 4)  # Q4_1: weight i low, weight i + 16 high
    return out.reshape(*lead, nbytes // Q4_K_BYTES * 8 * Q4_1_BYTES)


def as_q8_0(qtype: str, data: np.ndarray) -> np.ndarray:
    """uint8 rows of any GGUF type gguf-py dequantizes [..., bytes] -> the same weights re-quantized
    to Q8_0 blocks [..., k / 32 * 34] (module docstring: the bound)."""
    if qtype == "Q8_0":
        return data
    weights = dequantize(np.ascontiguousarray(data, dtype=np.uint8), GGMLQuantizationType[qtype])
    return quantize(weights.astype(np.float32, copy=False), GGMLQuantizationType.Q8_0)


def transcode(qtype: str, data: np.ndarray) -> tuple[str, np.ndarray]:
    """(the block type served, its bytes) for a tensor stored as `qtype`: k-quants rewritten,
    the blocks' own types as they are."""
    if qtype == "Q4_K":
        return "Q4_1", q4_k_to_q4_1(data)
    if qtype in TRANSCODED:
        return "Q8_0", as_q8_0(qtype, data)
    return qtype, data


def one_type(parts: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """Parts one kernel serves together (their rows concatenated): as they are in one type, else all
    re-quantized to Q8_0 (a Q4_K_M's attn_v in Q6_K beside its q and k in Q4_K)."""
    if len({q for q, _ in parts}) <= 1:
        return parts
    return [("Q8_0", as_q8_0(q, b)) for q, b in parts]
