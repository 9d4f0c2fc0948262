/* The float-activation GEMV on GGUF blocks for few rows (quant_matmul_cpu.c's direct path: each
 * block decoded once into registers and multiplied into every row). Shared by quant_matmul_cpu.c
 * and decode_stack_cpu.c; quant_matmul_cpu.c's header says why. */
#ifndef MOEBUS_QUANT_DIRECT_H
#define MOEBUS_QUANT_DIRECT_H
#include "gguf_blocks.h"

#if defined(__AVX512F__)
/* One block into the R rows' accumulators, 16 lanes: the 32 weights as two float vectors (elements
 * 0-15, 16-31), their products with x summed in the block, then scaled by d. */
INLINE void direct_block512(int qt, const uint8_t *blk, const float *x, int64_t xs, const float *xsum, int nb, int b,
                            int R, __m512 *acc, float *tail) {
    const float d = half_at(blk);
    __m512 w0, w1;
    if (qt == Q8_0) {
        w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (qt == Q4_1 ? 4 : 2))), low4 = _mm_set1_epi8(15);
        w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
        w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
        const float m = qt == Q4_1 ? half_at(blk + 2) : -8.f * d;
        for (int r = 0; r < R; r++) tail[r] += m * xsum[(int64_t)r * nb + b];
    }
    const __m512 dv = _mm512_set1_ps(d);
    for (int r = 0; r < R; r++) {
        const float *xb = x + (int64_t)r * xs + (int64_t)b * QK;
        const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        acc[r] = _mm512_fmadd_ps(dv, s, acc[r]);
    }
}
#endif

/* Direct path: rows [r0, r0 + R) of x against weight rows [n0, n1). xsum[r][b]: block sums of x. */
INLINE void direct_rows(int qt, const float *x, int64_t xs, const float *xsum, int nb, const uint8_t *w,
                        int64_t ws, int64_t n0, int64_t n1, int R, float *out, int64_t os) {
    const int bb = block_bytes(qt), qoff = qt == Q4_1 ? 4 : 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * ws;
        float tail[RMAX] = {0.f, 0.f, 0.f, 0.f}; /* sum over blocks of m_b * xsum_b */
#if defined(__AVX512F__)
        (void)qoff;
        /* Even and odd blocks into separate accumulators: at one row a single chain of dependent
         * FMAs would bound a block at their latency. */
        __m512 acc[2][RMAX];
        for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
        int b = 0;
        for (; b + 1 < nb; b += 2) {
            prefetch_ahead(row + (int64_t)b * bb);
            direct_block512(qt, row + (int64_t)b * bb, x, xs, xsum, nb, b, R, acc[0], tail);
            direct_block512(qt, row + (int64_t)(b + 1) * bb, x, xs, xsum, nb, b + 1, R, acc[1], tail);
        }
        if (b < nb) direct_block512(qt, row + (int64_t)b * bb, x, xs, xsum, nb, b, R, acc[0], tail);
        for (int r = 0; r < R; r++)
            out[(int64_t)r * os + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r])) + tail[r];
#elif MOEBUS_DOT_AVX2
        __m256 acc[RMAX];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        const __m128i low4 = _mm_set1_epi8(15);
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * bb;
            if (b % 2 == 0) prefetch_ahead(blk);
            const float d = half_at(blk);
            __m256 w0, w1, w2, w3;
            if (qt == Q8_0) {
                const int8_t *q = (const int8_t *)(blk + 2);
                w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
                w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
                w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16))));
                w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 24))));
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + qoff));
                const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                const float m = qt == Q4_1 ? half_at(blk + 2) : -8.f * d;
                for (int r = 0; r < R; r++) tail[r] += m * xsum[(int64_t)r * nb + b];
            }
            const __m256 dv = _mm256_set1_ps(d);
            for (int r = 0; r < R; r++) {
                const float *xb = x + (int64_t)r * xs + (int64_t)b * QK;
                __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
                s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);
                s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);
                s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);
                acc[r] = _mm256_fmadd_ps(dv, s, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[(int64_t)r * os + n] = _mm_cvtss_f32(v) + tail[r];
        }
#else
        float acc[RMAX] = {0.f, 0.f, 0.f, 0.f}, wf[QK];
        for (int b = 0; b < nb; b++) {
            dequant_block(qt, row + (int64_t)b * bb, wf);
            for (int r = 0; r < R; r++) {
                const float *xb = x + (int64_t)r * xs + (int64_t)b * QK;
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += wf[j] * xb[j];
                acc[r] += s;
            }
        }
        for (int r = 0; r < R; r++) out[(int64_t)r * os + n] = acc[r] + tail[r];
#endif
    }
}

/* Weight rows [n0, n1) for every x row, RMAX rows of x at a time. */
INLINE void direct_path(int qt, const float *x, int64_t xs, const float *xsum, int nb, const uint8_t *w, int64_t ws,
                        int64_t M, int64_t n0, int64_t n1, float *out, int64_t os) {
    for (int64_t m0 = 0; m0 < M; m0 += RMAX) {
        const int R = M - m0 < RMAX ? (int)(M - m0) : RMAX;
        const float *xm = x + m0 * xs, *sm = xsum + m0 * nb;
        float *om = out + m0 * os;
        /* R a compile-time constant in each call: the per-row loops unroll into registers. */
        switch (R) {
        case 1: direct_rows(qt, xm, xs, sm, nb, w, ws, n0, n1, 1, om, os); break;
        case 2: direct_rows(qt, xm, xs, sm, nb, w, ws, n0, n1, 2, om, os); break;
        case 3: direct_rows(qt, xm, xs, sm, nb, w, ws, n0, n1, 3, om, os); break;
        default: direct_rows(qt, xm, xs, sm, nb, w, ws, n0, n1, 4, om, os);
        }
    }
}
#endif
