/* Register-blocked dot products for skinny GEMMs on CPU (fused MoE, LM head with argmax): the dots
 * of 2 float32 rows a0, a1 against 4 weight rows w0..w3 (storage type t) of length n, in one pass.
 *
 * Why: a lone dot of length 128 runs at the latency of one FMA chain (~70 cycles on Zen 3); eight
 * independent accumulators keep both FMA pipes busy and load each row once per tile.
 * Every dot is summed the same way whatever tile or tile slot it lands in (8 lane partial sums in k
 * order, a fixed reduction tree, then the scalar tail in k order), so a row's results never depend
 * on which other rows share the call: callers stay batch-invariant.
 */
#ifndef MOEBUS_CPU_DOT_H
#define MOEBUS_CPU_DOT_H
#include "cpu_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MOEBUS_DOT_AVX2 1

/* 8 elements at p (storage type t) as float32. */
INLINE __m256 load8(enum dtype t, const char *p) {
    if (t == F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (t == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* The 8 lane sums of v[0..7], in order: two rounds of hadd leave sums of 4 lanes in each 128-bit
 * half, and adding the halves finishes them. */
INLINE __m256 reduce8(const __m256 *v) {
    const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
#else
#define MOEBUS_DOT_AVX2 0
#endif

/* out[4 * i + j] = a_i . w[j] for i < 2, j < 4 (rows may repeat: callers pad short tiles so). */
INLINE void dot_tile_2x4(enum dtype t, int es, const float *a0, const float *a1, const char *const w[4], int n,
                         float out[8]) {
    int k0 = 0;
#if MOEBUS_DOT_AVX2
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (; k0 + 8 <= n; k0 += 8) {
        const __m256 x0 = _mm256_loadu_ps(a0 + k0), x1 = _mm256_loadu_ps(a1 + k0);
        for (int j = 0; j < 4; j++) {
            const __m256 wj = load8(t, w[j] + (int64_t)k0 * es);
            acc[j] = _mm256_fmadd_ps(x0, wj, acc[j]);
            acc[4 + j] = _mm256_fmadd_ps(x1, wj, acc[4 + j]);
        }
    }
    _mm256_storeu_ps(out, reduce8(acc));
#else
    for (int j = 0; j < 8; j++) out[j] = 0.f;
#endif
    for (int k = k0; k < n; k++) {
        const float x0 = a0[k], x1 = a1[k];
        for (int j = 0; j < 4; j++) {
            const float wj = load1(t, w[j], k);
            out[j] += x0 * wj;
            out[4 + j] += x1 * wj;
        }
    }
}

/* dst[j][r] = round(rows[j] . w_r) for the n float32 rows and the nr weight rows w_r = w + r * ws
 * bytes, all of length len, in 2 x 4 tiles; edge tiles repeat a valid row and drop its results.
 * When the weight fits in L2 (re-reading it is cheap), rows go in blocks of ~16 KiB that stay in L1
 * while every weight row passes over them; a larger weight is streamed once over all rows. */
INLINE void dots_rows(enum dtype t, int es, const char *w, int64_t ws, int nr, const float *const *rows, int n,
                      int len, float *const *dst) {
    float o[8];
    int block = (int64_t)nr * ws > 262144 ? n : (int)(16384 / ((int64_t)len * 4 + 1)) & ~1;
    block = block < 2 ? 2 : block;
    for (int j0 = 0; j0 < n; j0 += block) {
        const int j_end = j0 + block < n ? j0 + block : n;
        for (int r = 0; r < nr; r += 4) {
            const char *wq[4];
            for (int q = 0; q < 4; q++) wq[q] = w + (int64_t)(r + q < nr ? r + q : nr - 1) * ws;
            const int nw = nr - r < 4 ? nr - r : 4;
            for (int j = j0; j < j_end; j += 2) {
                const int j1 = j + 1 < j_end ? j + 1 : j;
                dot_tile_2x4(t, es, rows[j], rows[j1], wq, len, o);
                for (int q = 0; q < nw; q++) dst[j][r + q] = round_to(t, o[q]);
                if (j1 != j)
                    for (int q = 0; q < nw; q++) dst[j1][r + q] = round_to(t, o[4 + q]);
            }
        }
    }
}

#endif
