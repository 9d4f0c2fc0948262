/* Linear layers on GGUF weight-only quantized weights: out[m][n] = x_m . dequant(w_n), the
 * semantics of kernels/quant_matmul.py's reference, with the weight dequantized inside the kernel.
 *
 * w is N rows of K / 32 GGUF blocks each (row stride ws bytes), ggml's layouts:
 *   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
 *   Q8_0 (34 bytes): f16 d, 32 int8; w = d * q
 * Byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).
 * x is float32 [M, K] (row stride xs elements), out float32 [M, N] (row stride os).
 *
 * Two paths. Few rows (decode): each block is decoded once into four 8-float vectors and
 * multiplied into every x row in registers, summing d * sum(q x) + m * sum(x) per block with the
 * block sums of x taken once per call: the weight streams from memory once, at 4.5-5 bits a
 * weight instead of 32, which is what bounds a decode step. Many rows (prefill, batches): panels of
 * 16 weight rows are dequantized into a float32 buffer that stays in L2, and cpu_dot.h's register
 * tiles run every x row over it, so the decode is amortised over the rows. Both paths compute each
 * row of x independently of the others in the call; the direct path is also taken for every row
 * count when the caller asks for one path (deterministic mode), since the two sum differently.
 */
#include <limits.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_dot.h"

enum qtype { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml's type ids */

#define QK 32    /* weights per block */
#define PANEL 16 /* weight rows dequantized together on the tiled path */
#define RMAX 4   /* x rows sharing one decoded block on the direct path */

INLINE int block_bytes(int qt) { return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : 34; }

INLINE float half_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* The 32 weights of one block as float32 (the reference's arithmetic). */
INLINE void dequant_block(int qt, const uint8_t *b, float *o) {
    const float d = half_at(b);
    if (qt == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
        return;
    }
    const uint8_t *q = b + (qt == Q4_1 ? 4 : 2);
    if (qt == Q4_1) {
        const float m = half_at(b + 2);
        for (int j = 0; j < QK / 2; j++) o[j] = d * (float)(q[j] & 15) + m, o[j + 16] = d * (float)(q[j] >> 4) + m;
    } else {
        for (int j = 0; j < QK / 2; j++) o[j] = d * (float)((q[j] & 15) - 8), o[j + 16] = d * (float)((q[j] >> 4) - 8);
    }
}

/* Direct path: rows [r0, r0 + R) of x against weight rows [n0, n1). xsum[r][b]: block sums of x. */
INLINE void direct_rows(int qt, const float *x, int64_t xs, const float *xsum, int nb, const uint8_t *w,
                        int64_t ws, int64_t n0, int64_t n1, int R, float *out, int64_t os) {
    const int bb = block_bytes(qt), qoff = qt == Q4_1 ? 4 : 2;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * ws;
        float tail[RMAX] = {0.f, 0.f, 0.f, 0.f}; /* sum over blocks of m_b * xsum_b */
#if MOEBUS_DOT_AVX2
        __m256 acc[RMAX];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        const __m128i low4 = _mm_set1_epi8(15);
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * bb;
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

/* Tiled path: panels [p0, p1) of PANEL weight rows, dequantized into buf, against every x row. */
static void tiled_path(int qt, const float *const *xrows, int nb, const uint8_t *w, int64_t ws, int64_t M,
                       int64_t N, int64_t p0, int64_t p1, float *buf, float **dst, float *out, int64_t os) {
    const int K = nb * QK, bb = block_bytes(qt);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * PANEL;
        const int nr = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++) dequant_block(qt, w + (n0 + r) * ws + (int64_t)b * bb, buf + (int64_t)r * K + b * QK);
        for (int64_t m = 0; m < M; m++) dst[m] = out + m * os + n0;
        dots_rows(F32, 4, (const char *)buf, (int64_t)K * 4, nr, xrows, (int)M, K, (float *const *)dst);
    }
}

INLINE int switch_qtype(int qt, int ok) { return ok && (qt == Q4_0 || qt == Q4_1 || qt == Q8_0); }

/* Returns 0 on success; 1 for an unknown type, K not a multiple of 32 or no memory (the caller
 * falls back to the reference). min_tiled_rows: the fewest rows that take the tiled path
 * (INT_MAX: always the direct path). */
int quant_matmul_f32(int qt, const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t M, int64_t N,
                     int64_t K, float *out, int64_t os, int min_tiled_rows) {
    if (!switch_qtype(qt, K % QK == 0 && K > 0 && K < INT_MAX / 2)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    const int64_t work = M * N * K;
    if (M < min_tiled_rows) {
        float *xsum = malloc((size_t)M * nb * sizeof(float) + 1);
        if (!xsum) return 1;
        for (int64_t m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += x[m * xs + b * QK + j];
                xsum[m * nb + b] = s;
            }
#pragma omp parallel if (work >= 262144)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            /* Contiguous ranges in multiples of 8 rows: each thread streams its own part of w. */
            const int64_t units = (N + 7) / 8;
            int64_t n0 = units * tid / nt * 8, n1 = units * (tid + 1) / nt * 8;
            n1 = n1 < N ? n1 : N;
            if (n0 < n1) {
                switch (qt) {
                case Q4_0: direct_path(Q4_0, x, xs, xsum, nb, w, ws, M, n0, n1, out, os); break;
                case Q4_1: direct_path(Q4_1, x, xs, xsum, nb, w, ws, M, n0, n1, out, os); break;
                default: direct_path(Q8_0, x, xs, xsum, nb, w, ws, M, n0, n1, out, os);
                }
            }
        }
        free(xsum);
        return 0;
    }
    const int nt_max = omp_get_max_threads();
    float *bufs = malloc((size_t)nt_max * PANEL * K * sizeof(float));
    float **dsts = malloc((size_t)nt_max * M * sizeof(float *));
    const float **xrows = malloc((size_t)M * sizeof(float *));
    if (!bufs || !dsts || !xrows) {
        free(bufs), free(dsts), free(xrows);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) xrows[m] = x + m * xs;
    const int64_t P = (N + PANEL - 1) / PANEL;
#pragma omp parallel if (work >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = P * tid / nt, p1 = P * (tid + 1) / nt;
        float *buf = bufs + (int64_t)tid * PANEL * K;
        float **dst = dsts + (int64_t)tid * M;
        switch (qt) {
        case Q4_0: tiled_path(Q4_0, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os); break;
        case Q4_1: tiled_path(Q4_1, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os); break;
        default: tiled_path(Q8_0, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os);
        }
    }
    free(bufs), free(dsts), free(xrows);
    return 0;
}
