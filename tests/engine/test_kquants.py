"""K-quants served on the blocks' kernels (loader/kquants.py): a Q4_K super-block rewritten as eight
Q4_1 blocks, Q6_K / Q5_K re-quantized to Q8_0, against gguf-py's own dequantization (the reference
reader); the test file writer's Q6_K read back by it."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from gguf.quants import dequantize

from moebus.engine.loader.kquants import Q4_1_BYTES, Q4_K_BYTES, as_q8_0, one_type, q4_k_to_q4_1, transcode
from moebus.loadtest.kquant_file import Q6_K_BYTES, quantize_q4_k, quantize_q6_k, target_type

Q4_K, Q4_1 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_1
Q6_K, Q5_K, Q8_0 = GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q8_0
Q5_K_BYTES = 176  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 32 of fifth bits, 128 of nibbles


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
    q4_0 = data[:, :18]
    assert transcode("Q4_0", q4_0) == ("Q4_0", q4_0)
    with pytest.raises(ValueError, match="super-blocks of 144"):
        q4_k_to_q4_1(np.zeros((2, 100), dtype=np.uint8))


def test_the_quantizer_writes_q6_k_that_gguf_reads_back():
    w = _weights(6, 512, seed=3)
    blocks = quantize_q6_k(w)
    assert blocks.shape == (6, 2 * Q6_K_BYTES)
    back = dequantize(blocks, Q6_K).reshape(w.shape)
    step = np.abs(w).reshape(6, -1, 16).max(2) / 31  # each 16-weight sub-block's step
    # half a step, plus the int8 sub-block scales' and the f16 d's rounding (measured: 0.501)
    assert (np.abs(back - w).reshape(6, -1, 16) <= step[:, :, None] * 0.52).all()


def _q5_k_blocks(n: int, seed: int) -> np.ndarray:
    """Random Q5_K super-blocks (no quantizer in gguf-py): any bytes are valid, d and dmin set sane."""
    rng = np.random.default_rng(seed)
    sb = rng.integers(0, 256, (n, Q5_K_BYTES), dtype=np.uint8)
    sb[:, 0:2] = rng.uniform(1e-4, 1e-3, (n, 1)).astype(np.float16).view(np.uint8)
    sb[:, 2:4] = rng.uniform(1e-4, 1e-3, (n, 1)).astype(np.float16).view(np.uint8)
    return sb


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K"])
def test_q6_k_and_q5_k_are_served_as_q8_0_within_its_rounding(qtype):
    """A weight moves by at most half a Q8_0 step (its block's absmax / 254) plus its scale's f16
    rounding (2^-11 of 127 steps): 1/254 + 2^-11 of the block's largest weight."""
    if qtype == "Q6_K":
        rows = quantize_q6_k(_weights(16, 1024, seed=4))
    else:
        rows = _q5_k_blocks(64, seed=5).reshape(16, 4 * Q5_K_BYTES)
    served, blocks = transcode(qtype, rows)
    assert served == "Q8_0" and blocks.shape == (16, 1024 // 32 * 34)
    want = dequantize(rows, GGMLQuantizationType[qtype]).reshape(-1, 32)
    got = dequantize(blocks, Q8_0).reshape(-1, 32)
    bound = np.abs(want).max(1, keepdims=True) * (1 / 254 + 2.0**-11) * 1.0001
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() > 0  # re-quantized, not copied


def test_parts_in_different_types_are_joined_as_q8_0():
    q4 = quantize_q4_k(_weights(4, 256, seed=6))
    q8 = np.asarray(transcode("Q8_0", np.zeros((4, 272), dtype=np.uint8))[1])
    same = [("Q4_1", q4_k_to_q4_1(q4)), ("Q4_1", q4_k_to_q4_1(q4))]
    assert one_type(same) is same
    mixed = one_type([("Q4_1", q4_k_to_q4_1(q4)), ("Q8_0", q8)])
    assert [q for q, _ in mixed] == ["Q8_0", "Q8_0"]
    assert mixed[1][1] is q8  # already Q8_0: the same bytes
    back = dequantize(mixed[0][1], Q8_0).reshape(-1, 32)
    want = dequantize(q4, Q4_K).reshape(-1, 32)
    assert (np.abs(back - want) <= np.abs(want).max(1, keepdims=True) * (1 / 254 + 2.0**-11) * 1.0001).all()
    assert as_q8_0("Q8_0", q8) is q8


def test_the_q4_k_m_mix_puts_q6_k_where_llama_quantize_does():
    """llama.cpp's Q4_K_M on 24 layers: attn_v and the down projections in Q6_K in layers 0-2, 5, 8,
    ..., 20 and 21-23 (use_more_bits), the embedding too; everything else in Q4_K."""
    def t(name: str) -> str:
        return target_type(name, [1024, 512], set(), "q4_k_m", 24).name
    six = [i for i in range(24) if t(f"blk.{i}.ffn_down_exps.weight") == "Q6_K"]
    assert six == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert t("blk.4.attn_v.weight") == "Q4_K" and t("blk.5.attn_v.weight") == "Q6_K"
    assert t("blk.5.attn_q.weight") == "Q4_K" and t("blk.5.ffn_up_exps.weight") == "Q4_K"
    assert t("token_embd.weight") == "Q6_K"
    assert target_type("blk.0.attn_v.weight", [1024, 512], set(), None, 24).name == "Q4_K"
    assert target_type("blk.0.attn_norm.weight", [1024], set(), "q4_k_m", 24) is None
