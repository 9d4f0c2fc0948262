/* Integer-activation GEMV pieces (the semantics of kernels/quant_matmul.py's quant_matmul_qa_ref):
 * quantize an activation row to int8 / int16 blocks of 32, then integer dots per weight block.
 * Shared by quant_dot_cpu.c (the linear layer) and decode_stack_cpu.c (the batch-1 decode step);
 * quant_dot_cpu.c's header says why and gives the arithmetic. */
#ifndef MOEBUS_QUANT_DOT_H
#define MOEBUS_QUANT_DOT_H
#include "gguf_blocks.h"

/* The 16-bit dot on AVX-512 (qa_block512): a block's 32 int16 products in one vpmaddwd. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOEBUS_QA512 1
#else
#define MOEBUS_QA512 0
#endif

/* Whether qa_rows wants a 16-bit activation block of a Q4 weight in nibble order: the 16 nibble
 * bytes read as 8 little-endian words, word i holds (low to high nibble) elements 2i, 2i + 16,
 * 2i + 1, 2i + 17; qa_block512 broadcasts the words to 4 lanes, shifts lane L right by 4L and masks,
 * so lane L, word i is element NIBBLE_ORDER(8 L + i), with no byte widening (a shuffle-port op). */
INLINE int nibble_order(int qt, int wide) { return MOEBUS_QA512 && wide && qt != Q8_0; }
#define NIBBLE_ORDER(p) (2 * ((p) % 8) + 16 * ((p) / 8 % 2) + (p) / 16)

/* One row of K floats -> K / 32 blocks: q (K int8, or int16 when wide; nib: each block in nibble
 * order, see above, only where nibble_order says so), d[b * st] and ds[b * st] = d * sum(q) (the GEMV
 * interleaves them, st = 2: one 8-byte load a block). */
INLINE void quantize_row(int wide, int nib, const float *x, int nb, void *q, float *d, float *ds, int st) {
    const float qmax = wide ? 32767.f : 127.f;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)b * QK;
#if MOEBUS_DOT_AVX2
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float db = _mm_cvtss_f32(m4) / qmax, id = db > 0.f ? 1.f / db : 0.f;
        const __m256 iv = _mm256_set1_ps(id);
        /* cvtps rounds to nearest even (the default MXCSR mode), as rint and torch.round */
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* packs work per 128-bit lane, so groups of 4 (int16: of 4 per input) come out interleaved
         * across the lanes; one permute puts them back in element order. */
        const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        if (wide) {
            int16_t *qb = (int16_t *)q + (int64_t)b * QK;
            _mm256_storeu_si256((__m256i *)qb, _mm256_permute4x64_epi64(p01, 0xd8));
            _mm256_storeu_si256((__m256i *)(qb + 16), _mm256_permute4x64_epi64(p23, 0xd8));
#if MOEBUS_QA512
            if (nib) {
                const __m512i idx = _mm512_set_epi16(
                    NIBBLE_ORDER(31), NIBBLE_ORDER(30), NIBBLE_ORDER(29), NIBBLE_ORDER(28), NIBBLE_ORDER(27),
                    NIBBLE_ORDER(26), NIBBLE_ORDER(25), NIBBLE_ORDER(24), NIBBLE_ORDER(23), NIBBLE_ORDER(22),
                    NIBBLE_ORDER(21), NIBBLE_ORDER(20), NIBBLE_ORDER(19), NIBBLE_ORDER(18), NIBBLE_ORDER(17),
                    NIBBLE_ORDER(16), NIBBLE_ORDER(15), NIBBLE_ORDER(14), NIBBLE_ORDER(13), NIBBLE_ORDER(12),
                    NIBBLE_ORDER(11), NIBBLE_ORDER(10), NIBBLE_ORDER(9), NIBBLE_ORDER(8), NIBBLE_ORDER(7),
                    NIBBLE_ORDER(6), NIBBLE_ORDER(5), NIBBLE_ORDER(4), NIBBLE_ORDER(3), NIBBLE_ORDER(2),
                    NIBBLE_ORDER(1), NIBBLE_ORDER(0));
                _mm512_storeu_si512(qb, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(qb)));
            }
#endif
        } else {
            const __m256i p = _mm256_packs_epi16(p01, p23);
            _mm256_storeu_si256((__m256i *)((int8_t *)q + (int64_t)b * QK),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        d[b * st] = db, ds[b * st] = db * (float)_mm_cvtsi128_si32(s4);
        (void)nib;
#else
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float db = amax / qmax, id = db > 0.f ? 1.f / db : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int v = (int)rintf(xb[j] * id);
            if (wide) ((int16_t *)q)[(int64_t)b * QK + j] = (int16_t)v;
            else ((int8_t *)q)[(int64_t)b * QK + j] = (int8_t)v;
            sum += v;
        }
        d[b * st] = db, ds[b * st] = db * (float)sum;
        (void)nib; /* no AVX-512 without AVX2: never set here */
#endif
    }
}

#if MOEBUS_DOT_AVX2
/* 8 int32 lanes, each the sum of 4 products of unsigned u by signed s bytes (no overflow here:
 * |u| <= 128, |s| <= 127, so maddubs' int16 pair sums stay below 32767). */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Block b of a weight row against R quantized rows (q: row stride K elements; dd: (d, d * sum(q))
 * pairs, row stride 2 nb): acc[r] += (dw * d) * the 8 int32 lane dots, lane 1 of tail[r] += the
 * offset term. The block's scales convert in one instruction and multiply the row's pair at once. */
INLINE void qa_block(int qt, int wide, const uint8_t *blk, const void *q, const float *dd, int nb, int64_t K, int b,
                     int R, __m256 *acc, __m128 *tail) {
    uint32_t head; /* Q4_1: f16 d and m; else f16 d (the upper half, quants, is zeroed) */
    memcpy(&head, blk, sizeof head);
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(qt == Q4_1 ? head : head & 0xffffu))); /* [dw, m] */
    if (qt == Q4_0) dm = _mm_mul_ps(_mm_moveldup_ps(dm), _mm_setr_ps(1.f, -8.f, 0.f, 0.f)); /* [dw, -8 dw] */
    __m256i u, w0, w1; /* int8: u, the 32 weights as bytes; int16: w0, w1, weights 0-15 and 16-31 */
    if (qt == Q8_0) {
        u = _mm256_loadu_si256((const __m256i *)(blk + 2));
        w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(u)), w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(u, 1));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (qt == Q4_1 ? 4 : 2))), low4 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        u = _mm256_set_m128i(hi, lo);
        w0 = _mm256_cvtepu8_epi16(lo), w1 = _mm256_cvtepu8_epi16(hi);
    }
    for (int r = 0; r < R; r++) {
        __m256i p;
        if (wide) { /* |w| <= 128, |q| <= 32767: a madd lane stays below 2^23 */
            const int16_t *qb = (const int16_t *)q + r * K + (int64_t)b * QK;
            p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)qb)),
                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(qb + 16))));
        } else {
            const __m256i s = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + r * K + (int64_t)b * QK));
            /* Q8_0 is signed by signed: |v| by q carrying v's sign, the same products */
            p = qt == Q8_0 ? dot_u8s8(_mm256_sign_epi8(u, u), _mm256_sign_epi8(s, u)) : dot_u8s8(u, s);
        }
        const __m128 pr = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)(dd + 2 * ((int64_t)r * nb + b)))));
        if (qt != Q8_0) tail[r] = _mm_add_ps(tail[r], pr); /* lane 1: m * (d * sum(q)) */
        acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(pr), _mm256_cvtepi32_ps(p), acc[r]); /* lane 0: dw * d */
    }
}
#endif

#if MOEBUS_QA512
/* qa_block for 16-bit activations in 16 lanes: the block's 32 weights as int16 in one register
 * (Q4: the nibble words broadcast to the 4 lanes, shifted and masked, activations in nibble order;
 * Q8_0: widened in element order), one vpmaddwd a row. The block's scales as in qa_block: f16 d
 * and m converted from the block's first 8 bytes (lanes 2-3 read quant bytes, never used). */
INLINE void qa_block512(int qt, const uint8_t *blk, const int16_t *q, const float *dd, int nb, int64_t K, int b,
                        int R, __m512 *acc, __m128 *tail) {
    __m128 dm = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)); /* [dw, m, -, -] */
    if (qt == Q4_0) dm = _mm_mul_ps(_mm_moveldup_ps(dm), _mm_setr_ps(1.f, -8.f, 0.f, 0.f)); /* [dw, -8 dw] */
    __m512i w;
    if (qt == Q8_0) {
        w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
    } else {
        const __m512i words = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + (qt == Q4_1 ? 4 : 2))));
        const __m512i shifts = _mm512_set_epi64(0x000c000c000c000cLL, 0x000c000c000c000cLL, 0x0008000800080008LL,
                                                0x0008000800080008LL, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
        w = _mm512_and_si512(_mm512_srlv_epi16(words, shifts), _mm512_set1_epi16(15));
    }
    for (int r = 0; r < R; r++) {
        const __m512i p = _mm512_madd_epi16(w, _mm512_loadu_si512(q + r * K + (int64_t)b * QK));
        const __m128 pr = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)(dd + 2 * ((int64_t)r * nb + b)))));
        if (qt != Q8_0) tail[r] = _mm_add_ps(tail[r], pr); /* lane 1: m * (d * sum(q)) */
        acc[r] = _mm512_fmadd_ps(_mm512_broadcastss_ps(pr), _mm512_cvtepi32_ps(p), acc[r]); /* lane 0: dw * d */
    }
}
#endif

/* Weight rows [n0, n1) against R quantized rows (dd: (d, d * sum(q)) per block, row stride 2 nb). */
INLINE void qa_rows(int qt, int wide, const void *q, const float *dd, int nb, const uint8_t *w,
                    int64_t ws, int64_t n0, int64_t n1, int R, float *out, int64_t os) {
    const int bb = block_bytes(qt);
    const int64_t K = (int64_t)nb * QK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * ws;
#if MOEBUS_QA512
        if (wide) { /* as below, 16 lanes */
            __m512 acc[2][RMAX];
            __m128 tl[2][RMAX];
            for (int r = 0; r < R; r++)
                acc[0][r] = acc[1][r] = _mm512_setzero_ps(), tl[0][r] = tl[1][r] = _mm_setzero_ps();
            int b = 0;
            for (; b + 1 < nb; b += 2) {
                prefetch_ahead(row + (int64_t)b * bb);
                qa_block512(qt, row + (int64_t)b * bb, (const int16_t *)q, dd, nb, K, b, R, acc[0], tl[0]);
                qa_block512(qt, row + (int64_t)(b + 1) * bb, (const int16_t *)q, dd, nb, K, b + 1, R, acc[1], tl[1]);
            }
            if (b < nb) qa_block512(qt, row + (int64_t)b * bb, (const int16_t *)q, dd, nb, K, b, R, acc[0], tl[0]);
            for (int r = 0; r < R; r++) {
                const __m128 t = _mm_add_ps(tl[0][r], tl[1][r]);
                out[(int64_t)r * os + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) +
                                           _mm_cvtss_f32(_mm_movehdup_ps(t));
            }
            continue;
        }
#endif
#if MOEBUS_DOT_AVX2
        /* Even and odd blocks into separate accumulators: one chain of dependent FMAs (and of
         * offset sums) would bound a block at their latency. */
        __m256 acc[2][RMAX];
        __m128 tl[2][RMAX];
        for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps(), tl[0][r] = tl[1][r] = _mm_setzero_ps();
        int b = 0;
        for (; b + 1 < nb; b += 2) {
            prefetch_ahead(row + (int64_t)b * bb);
            qa_block(qt, wide, row + (int64_t)b * bb, q, dd, nb, K, b, R, acc[0], tl[0]);
            qa_block(qt, wide, row + (int64_t)(b + 1) * bb, q, dd, nb, K, b + 1, R, acc[1], tl[1]);
        }
        if (b < nb) qa_block(qt, wide, row + (int64_t)b * bb, q, dd, nb, K, b, R, acc[0], tl[0]);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_add_ps(acc[0][r], acc[1][r]);
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            const __m128 t = _mm_add_ps(tl[0][r], tl[1][r]);
            out[(int64_t)r * os + n] = _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_movehdup_ps(t));
        }
#else
        float acc[RMAX] = {0.f, 0.f, 0.f, 0.f}, tail[RMAX] = {0.f, 0.f, 0.f, 0.f}; /* tail: the offset terms */
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * bb;
            const float dw = half_at(blk);
            int wq[QK];
            if (qt == Q8_0) {
                for (int j = 0; j < QK; j++) wq[j] = ((const int8_t *)(blk + 2))[j];
            } else {
                const uint8_t *nib = blk + (qt == Q4_1 ? 4 : 2);
                for (int j = 0; j < QK / 2; j++) wq[j] = nib[j] & 15, wq[j + 16] = nib[j] >> 4;
                const float m = qt == Q4_1 ? half_at(blk + 2) : -8.f * dw;
                for (int r = 0; r < R; r++) tail[r] += m * dd[2 * ((int64_t)r * nb + b) + 1];
            }
            for (int r = 0; r < R; r++) {
                const int64_t at = r * K + (int64_t)b * QK;
                int isum = 0;
                for (int j = 0; j < QK; j++) isum += wq[j] * (wide ? ((const int16_t *)q)[at + j] : ((const int8_t *)q)[at + j]);
                acc[r] += dw * dd[2 * ((int64_t)r * nb + b)] * (float)isum;
            }
        }
        for (int r = 0; r < R; r++) out[(int64_t)r * os + n] = acc[r] + tail[r];
#endif
    }
}

INLINE void qa_path(int qt, int wide, const void *q, const float *dd, int nb, const uint8_t *w,
                    int64_t ws, int64_t M, int64_t n0, int64_t n1, float *out, int64_t os) {
    const int64_t K = (int64_t)nb * QK;
    for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
        const int R = M - m0 < RMAX ? (int)(M - m0) : RMAX;
        const void *qm = (const char *)q + m0 * K * (wide ? 2 : 1);
        const float *dm = dd + 2 * m0 * nb;
        float *om = out + m0 * os;
        switch (R) { /* R a compile-time constant in each call: the row loops unroll into registers */
        case 1: qa_rows(qt, wide, qm, dm, nb, w, ws, n0, n1, 1, om, os); break;
        case 2: qa_rows(qt, wide, qm, dm, nb, w, ws, n0, n1, 2, om, os); break;
        case 3: qa_rows(qt, wide, qm, dm, nb, w, ws, n0, n1, 3, om, os); break;
        default: qa_rows(qt, wide, qm, dm, nb, w, ws, n0, n1, 4, om, os);
        }
    }
}
#endif
