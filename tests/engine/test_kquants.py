"""Q4_K served on the blocks' kernels (loader/kquants.py): a super-block rewritten as eight Q4_1
blocks against gguf-py's own dequantization of both (the reference reader)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from gguf.quants import dequantize

from moebus.engine.loader.kquants import Q4_1_BYTES, Q4_K_BYTES, q4_k_to_q4_1, transcode
from moebus.loadtest.kquant_file import quantize_q4_k

Q4_K, Q4_1 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_1


def _weights(rows: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)) * rng.uniform(0.01, 0.2, (rows, 1))).astype(np.float32)


def test_the_quantizer_writes_q4_k_that_gguf_reads_back():
    w = _weights(6, 512)
    blocks = quantize_q4_k(w)
    assert blocks.shape == (6, 2 * Q4_K_BYTES)
    back = dequantize(blocks, Q4_K).reshape(w.shape)
    step = (w.max(1) - np.minimum(w.min(1), 0)) / 15  # a row's widest 4-bit step
    assert (np.abs(back - w) <= step[:, None] * 0.75).all()  # half a step, plus the 6-bit scales' rounding


def test_q4_1_blocks_hold_the_q4_k_weights_to_f16_rounding_of_the_scales():
    blocks = quantize_q4_k(_weights(16, 1024, seed=1))
    q41 = q4_k_to_q4_1(blocks)
    assert q41.shape == (16, 1024 // 32 * Q4_1_BYTES)
    want = dequantize(blocks, Q4_K).reshape(16, 1024)
    got = dequantize(q41, Q4_1).reshape(16, 1024)
    # per sub-block: d * sc and dmin * m each rounded to f16 (half an ulp: 2^-11 of the value), the
    # nibble at most 15
    sb = blocks.reshape(-1, Q4_K_BYTES)
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, mn = quants.Q4_K.get_scale_min(sb[:, 4:16])
    bound = (2.0**-11 * (15 * d * sc + dmin * mn)).reshape(16, 1024 // 32)
    err = np.abs(got.astype(np.float64) - want).reshape(16, -1, 32).max(-1)
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    print(f"max |Q4_1 - Q4_K| {err.max():.2e}, largest weight {np.abs(want).max():.2f}")


def test_scales_that_fit_f16_give_the_same_weights_exactly():
    """d a power of two: every d * sc and dmin * m is an f16, so the rewrite is exact (and its nibble
    layout is checked bit for bit)."""
    rng = np.random.default_rng(2)
    sb = rng.integers(0, 256, (12, Q4_K_BYTES), dtype=np.uint8)
    sb[:, 0:2] = np.full((12, 1), 2.0**-9, dtype=np.float16).view(np.uint8)
    sb[:, 2:4] = np.full((12, 1), 2.0**-10, dtype=np.float16).view(np.uint8)
    rows = sb.reshape(3, 4 * Q4_K_BYTES)
    want = dequantize(rows, Q4_K)
    got = dequantize(q4_k_to_q4_1(rows), Q4_1)
    assert np.array_equal(got, want)


def test_other_types_pass_through_and_a_ragged_row_is_refused():
    data = np.zeros((2, 34), dtype=np.uint8)
    assert transcode("Q8_0", data) == ("Q8_0", data)
    with pytest.raises(ValueError, match="super-blocks of 144"):
        q4_k_to_q4_1(np.zeros((2, 100), dtype=np.uint8))
