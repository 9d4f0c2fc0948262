/* GGUF weights re-laid in panels of 16 output rows, on 16-bit integer activations, one formula for
 * every row count (kernels/qpanel.py says why). Shared by qpanel_cpu.c (the linear layer) and
 * decode_stack_cpu.c (the batch-1 step), so a row's result is the same bits in both.
 *
 * Layout: panel p holds outputs 16p..16p+15 (zero past N), block after block of K / 32; a block is
 *   codes: Q4 256 bytes = 4 groups of 8 elements; group g's dword o (output o) holds, in its low
 *          word, nibble t = element 8g + 2t, in its high word nibble t = element 8g + 2t + 1
 *          ((x >> 4t) & 0x000f000f is output o's pair (8g + 2t, 8g + 2t + 1) as two int16: one
 *          shift and one and a register of 16 outputs);
 *          Q8_0 512 bytes = 8 groups of 4; group g's dword o holds bytes v[4g], v[4g + 2], v[4g + 1],
 *          v[4g + 3] (words sign-extended from the low bytes: pair (4g, 4g + 1); from the high ones:
 *          pair (4g + 2, 4g + 3));
 *   then 16 f16 scales d, and for Q4_1 16 f16 mins m.
 * The product of row x and output n (x quantized as quant_dot.h's quantize_row: int16 q, d, d sum q):
 *   acc = 0; per block b in order: i = sum_j w_j q_j (int32, exact; Q4 w = the nibble 0..15)
 *   acc = fma((float)i, dw * d, acc); then Q4_1: acc = fma(m, d sum q, acc), Q4_0: fma(-8 dw, ...).
 * Integer sums are exact in any order, and the float steps are per (row, output) in block order, so
 * any tiling of rows and outputs gives the same bits. */
#ifndef MOEBUS_QPANEL_H
#define MOEBUS_QPANEL_H
#include "quant_dot.h"

#define QP_W 16 /* outputs a panel */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOEBUS_QP512 1
#else
#define MOEBUS_QP512 0
#endif

INLINE int qp_code_bytes(int qt) { return qt == Q8_0 ? 512 : 256; }
INLINE int qp_block_bytes(int qt) { return qp_code_bytes(qt) + (qt == Q4_1 ? 64 : 32); }


/* Element j of one output's GGUF block as an integer (Q4: the nibble; Q8_0: the signed byte). */
INLINE int gguf_elem(int qt, const uint8_t *blk, int j) {
    if (qt == Q8_0) return ((const int8_t *)(blk + 2))[j];
    const uint8_t *nib = blk + (qt == Q4_1 ? 4 : 2);
    return j < 16 ? nib[j] & 15 : nib[j - 16] >> 4;
}

/* One panel block from the GGUF rows rows[0..nr) (the rest zero) into dst. */
INLINE void qp_pack_block(int qt, const uint8_t *const *rows, int nr, uint8_t *dst) {
    const int cb = qp_code_bytes(qt);
    memset(dst, 0, (size_t)qp_block_bytes(qt));
    for (int o = 0; o < nr; o++) {
        const uint8_t *blk = rows[o];
        if (qt == Q8_0) {
            for (int g = 0; g < 8; g++) {
                uint8_t *dw = dst + 64 * g + 4 * o;
                const int order[4] = {0, 2, 1, 3};
                for (int i = 0; i < 4; i++) dw[i] = (uint8_t)gguf_elem(qt, blk, 4 * g + order[i]);
            }
        } else {
            for (int g = 0; g < 4; g++) {
                uint32_t v = 0;
                for (int t = 0; t < 4; t++)
                    v |= (uint32_t)gguf_elem(qt, blk, 8 * g + 2 * t) << (4 * t) |
                         (uint32_t)gguf_elem(qt, blk, 8 * g + 2 * t + 1) << (16 + 4 * t);
                memcpy(dst + 64 * g + 4 * o, &v, 4);
            }
        }
        memcpy(dst + cb + 2 * o, blk, 2); /* d */
        if (qt == Q4_1) memcpy(dst + cb + 32 + 2 * o, blk + 2, 2); /* m */
    }
}

/* Plain C: the formula above for R rows (xq row stride K, dd (d, d sum q) pairs, stride 2 nb) and
 * the panel's outputs [0, nc). The reference of the SIMD tile and the path without AVX-512. */
INLINE void qp_tile_c(int qt, const uint8_t *pan, int nb, const int16_t *xq, const float *dd, int64_t K, int R,
                      float *out, int64_t os, int nc) {
    const int cb = qp_code_bytes(qt), bb = qp_block_bytes(qt);
    for (int r = 0; r < R; r++)
        for (int o = 0; o < nc; o++) {
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = pan + (int64_t)b * bb;
                const int16_t *q = xq + r * K + (int64_t)b * QK;
                int32_t i = 0;
                for (int g = 0; g < (qt == Q8_0 ? 8 : 4); g++) {
                    const uint8_t *c = blk + 64 * g + 4 * o;
                    if (qt == Q8_0) {
                        i += (int8_t)c[0] * q[4 * g] + (int8_t)c[2] * q[4 * g + 1] + (int8_t)c[1] * q[4 * g + 2] +
                             (int8_t)c[3] * q[4 * g + 3];
                    } else {
                        uint32_t v;
                        memcpy(&v, c, 4);
                        for (int t = 0; t < 4; t++)
                            i += (int)(v >> (4 * t) & 15) * q[8 * g + 2 * t] + (int)(v >> (16 + 4 * t) & 15) * q[8 * g + 2 * t + 1];
                    }
                }
                const float dw = half_at(blk + cb + 2 * o), d = dd[2 * ((int64_t)r * nb + b)];
                acc = fmaf((float)i, dw * d, acc);
                if (qt != Q8_0) {
                    const float m = qt == Q4_1 ? half_at(blk + cb + 32 + 2 * o) : -8.f * dw;
                    acc = fmaf(m, dd[2 * ((int64_t)r * nb + b) + 1], acc);
                }
            }
            out[(int64_t)r * os + o] = acc;
        }
}

#if MOEBUS_QP512
#if defined(__AVX512VNNI__)
#define QP_DOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define QP_DOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif

/* P panels (stride ps bytes) x R rows: the formula above in 16 lanes = 16 outputs; the pair of
 * activations a dword broadcast to every lane. nc: the valid outputs of the last panel. */
INLINE void qp_tile512(int qt, const uint8_t *pan, int64_t ps, int P, int nb, const int16_t *xq, const float *dd,
                       int64_t K, int R, float *out, int64_t os, int nc) {
    enum { PM = 4, RM = 4 };
    const int cb = qp_code_bytes(qt), bb = qp_block_bytes(qt);
    __m512 acc[PM][RM];
    for (int p = 0; p < P; p++)
        for (int r = 0; r < R; r++) acc[p][r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0x000f000f);
    for (int b = 0; b < nb; b++) {
        __m512i is[PM][RM];
        for (int p = 0; p < P; p++)
            for (int r = 0; r < R; r++) is[p][r] = _mm512_setzero_si512();
        const int32_t *xp[RM];
        for (int r = 0; r < R; r++) xp[r] = (const int32_t *)(xq + r * K + (int64_t)b * QK);
        const uint8_t *blk = pan + (int64_t)b * bb;
        /* Q4: a line 6 blocks ahead a panel. Q8_0's 544-byte blocks stream faster on the hardware
         * prefetcher alone (Zen 4, one row: SmolLM2-shaped layers 5.07 -> 4.64 ms, 24 MoE layers'
         * experts 12.7 -> 11.8 ms; Q4_1 unchanged within 2%) */
        if (qt != Q8_0)
            for (int p = 0; p < P; p++) __builtin_prefetch(blk + p * ps + 6 * bb, 0, 3);
        if (qt == Q8_0) {
            for (int g = 0; g < 8; g++) {
                __m512i x[PM];
                for (int p = 0; p < P; p++) x[p] = _mm512_loadu_si512(blk + p * ps + 64 * g);
                for (int p = 0; p < P; p++) {
                    const __m512i w0 = _mm512_srai_epi16(_mm512_slli_epi16(x[p], 8), 8), w1 = _mm512_srai_epi16(x[p], 8);
                    for (int r = 0; r < R; r++) {
                        is[p][r] = QP_DOT(is[p][r], w0, _mm512_set1_epi32(xp[r][2 * g]));
                        is[p][r] = QP_DOT(is[p][r], w1, _mm512_set1_epi32(xp[r][2 * g + 1]));
                    }
                }
            }
        } else {
            for (int g = 0; g < 4; g++) {
                __m512i x[PM];
                for (int p = 0; p < P; p++) x[p] = _mm512_loadu_si512(blk + p * ps + 64 * g);
                for (int t = 0; t < 4; t++)
                    for (int p = 0; p < P; p++) {
                        const __m512i w = _mm512_and_si512(t ? _mm512_srli_epi32(x[p], 4 * t) : x[p], low);
                        for (int r = 0; r < R; r++) is[p][r] = QP_DOT(is[p][r], w, _mm512_set1_epi32(xp[r][4 * g + t]));
                    }
            }
        }
        for (int p = 0; p < P; p++) {
            const uint8_t *sc = blk + p * ps + cb;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
            const __m512 m = qt == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)))
                                        : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
            for (int r = 0; r < R; r++) {
                const float *dr = dd + 2 * ((int64_t)r * nb + b);
                acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[p][r]), _mm512_mul_ps(dw, _mm512_set1_ps(dr[0])),
                                            acc[p][r]);
                if (qt != Q8_0) acc[p][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dr[1]), acc[p][r]);
            }
        }
    }
    for (int p = 0; p < P; p++) {
        const __mmask16 keep = p == P - 1 && nc < QP_W ? (__mmask16)((1u << nc) - 1) : (__mmask16)0xffff;
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (int64_t)r * os + p * QP_W, keep, acc[p][r]);
    }
}
#endif

/* Outputs [n0, n1) (n0 a multiple of 16) of R <= 4 rows: panels in groups of P (4 for one row,
 * whose 16 dots a block chain otherwise; 2 beside more rows), compile-time R and P each call. */
INLINE void qp_rows(int qt, const uint8_t *pans, int nb, const int16_t *xq, const float *dd, int64_t K, int R,
                    int64_t n0, int64_t n1, float *out, int64_t os) {
    const int64_t ps = (int64_t)nb * qp_block_bytes(qt);
    for (int64_t n = n0; n < n1;) {
        const int64_t left = n1 - n;
#if MOEBUS_QP512
        const int P = R == 1 ? (left > 48 ? 4 : (int)((left + 15) / 16)) : (left > 16 ? 2 : 1);
        const int nc = (int)(left - (int64_t)(P - 1) * QP_W < QP_W ? left - (int64_t)(P - 1) * QP_W : QP_W);
        const uint8_t *pan = pans + n / QP_W * ps;
#define QP_TILE(PP, RR) qp_tile512(qt, pan, ps, PP, nb, xq, dd, K, RR, out + n, os, nc)
        switch (R * 8 + P) { /* constants per call: the tile's loops unroll into registers */
        case 8 + 1: QP_TILE(1, 1); break;
        case 8 + 2: QP_TILE(2, 1); break;
        case 8 + 3: QP_TILE(3, 1); break;
        case 8 + 4: QP_TILE(4, 1); break;
        case 16 + 1: QP_TILE(1, 2); break;
        case 16 + 2: QP_TILE(2, 2); break;
        case 24 + 1: QP_TILE(1, 3); break;
        case 24 + 2: QP_TILE(2, 3); break;
        case 32 + 1: QP_TILE(1, 4); break;
        default: QP_TILE(2, 4);
        }
#undef QP_TILE
        n += (int64_t)P * QP_W;
#else
        const int nc = left < QP_W ? (int)left : QP_W;
        qp_tile_c(qt, pans + n / QP_W * ps, nb, xq, dd, K, R, out + n, os, nc);
        n += QP_W;
#endif
    }
}

/* Any row count against outputs [n0, n1): rows in blocks of QP_MB, outputs in chunks of QP_NC
 * (a chunk's panels stay in L2 while every row group of the block passes over them), rows in
 * fours within. */
#define QP_MB 256
#define QP_NC 128
INLINE void qp_path(int qt, const uint8_t *pans, int nb, const int16_t *xq, const float *dd, int64_t M, int64_t n0,
                    int64_t n1, float *out, int64_t os) {
    const int64_t K = (int64_t)nb * QK;
    for (int64_t mb = 0; mb < M; mb += QP_MB) {
        const int64_t me = M - mb < QP_MB ? M : mb + QP_MB;
        for (int64_t c0 = n0; c0 < n1; c0 += QP_NC) {
            const int64_t c1 = n1 - c0 < QP_NC ? n1 : c0 + QP_NC;
            for (int64_t m0 = mb; m0 < me; m0 += 4) {
                const int R = me - m0 < 4 ? (int)(me - m0) : 4;
                const int16_t *xm = xq + m0 * K;
                const float *dm = dd + 2 * m0 * nb;
                float *om = out + m0 * os;
                switch (R) {
                case 1: qp_rows(qt, pans, nb, xm, dm, K, 1, c0, c1, om, os); break;
                case 2: qp_rows(qt, pans, nb, xm, dm, K, 2, c0, c1, om, os); break;
                case 3: qp_rows(qt, pans, nb, xm, dm, K, 3, c0, c1, om, os); break;
                default: qp_rows(qt, pans, nb, xm, dm, K, 4, c0, c1, om, os);
                }
            }
        }
    }
}
#endif
