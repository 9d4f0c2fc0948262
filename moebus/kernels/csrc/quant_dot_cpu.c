/* GGUF-block linear layers on integer activations: out[m][n] = qa(x_m) . dequant(w_n), integer dot
 * products per 32-weight block. The semantics of kernels/quant_matmul.py's quant_matmul_qa_ref.
 *
 * Why: decoding every weight block to float32 (quant_matmul_cpu.c's direct path) costs ~4 ns a
 * block on one Zen 3 core, most of a batch-1 decode step. Quantizing the activation row once per
 * call to integer blocks lets each weight block be a few integer multiply-adds into int32 lanes and
 * one float multiply-add. Two activation widths:
 *   8 bits  (as llama.cpp's Q8 activations): AVX2 maddubs + madd, or one VNNI dpbusd, a block;
 *   16 bits: two madd_epi16 a block, the weight widened to int16; ~256x less rounding error.
 *
 * Activation block (32 floats x), QMAX = 127 or 32767: amax = max |x|, d = amax / QMAX,
 * q = rint(x * (1 / d)) (nearest even; q = 0 when d = 0), kept as q, float d, and d * sum(q) (for the
 * weight's offset term). Per weight block (scale dw; Q4_1 min mw; nibbles u in 0..15, Q8_0 int8 v):
 *   Q4_0: (dw * d) * sum(u q) + (-8 dw) * (d * sum(q))
 *   Q4_1: (dw * d) * sum(u q) + mw * (d * sum(q))
 *   Q8_0: (dw * d) * sum(v q)
 * summed over blocks in float32. Weight layouts as quant_matmul_cpu.c. Rows of x are independent:
 * a row's result is the same whatever the row count of the call.
 */
#include <limits.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_dot.h" /* MOEBUS_DOT_AVX2 and <immintrin.h> */

enum qtype { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml's type ids */

#define QK 32
#define RMAX 4 /* x rows sharing one loaded weight block */

INLINE int block_bytes(int qt) { return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : 34; }

INLINE float half_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* One row of K floats -> K / 32 blocks: q (K int8, or int16 when wide), d[b * st] and ds[b * st] =
 * d * sum(q) (the GEMV interleaves them, st = 2: one 8-byte load a block). */
INLINE void quantize_row(int wide, const float *x, int nb, void *q, float *d, float *ds, int st) {
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
        } else {
            const __m256i p = _mm256_packs_epi16(p01, p23);
            _mm256_storeu_si256((__m256i *)((int8_t *)q + (int64_t)b * QK),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        d[b * st] = db, ds[b * st] = db * (float)_mm_cvtsi128_si32(s4);
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

/* Weight rows [n0, n1) against R quantized rows (dd: (d, d * sum(q)) per block, row stride 2 nb). */
INLINE void qa_rows(int qt, int wide, const void *q, const float *dd, int nb, const uint8_t *w,
                    int64_t ws, int64_t n0, int64_t n1, int R, float *out, int64_t os) {
    const int bb = block_bytes(qt);
    const int64_t K = (int64_t)nb * QK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * ws;
#if MOEBUS_DOT_AVX2
        /* Even and odd blocks into separate accumulators: one chain of dependent FMAs (and of
         * offset sums) would bound a block at their latency. */
        __m256 acc[2][RMAX];
        __m128 tl[2][RMAX];
        for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps(), tl[0][r] = tl[1][r] = _mm_setzero_ps();
        int b = 0;
        for (; b + 1 < nb; b += 2) {
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

INLINE int bad_k(int64_t K) { return K % QK != 0 || K <= 0 || K >= INT_MAX / 2; }

/* The activation quantization alone (tests compare it with the torch reference bit for bit):
 * x [M, K] (row stride xs) -> q [M, K] (int8, int16 when bits == 16), d and d * sum(q) [M, K / 32].
 * Returns 1 when K % 32 != 0 or bits is not 8 or 16. */
int quantize_act_f32(int bits, const float *x, int64_t xs, int64_t M, int64_t K, void *q, float *d, float *ds) {
    if (bad_k(K) || (bits != 8 && bits != 16)) return 1;
    const int nb = (int)(K / QK);
    for (int64_t m = 0; m < M; m++) {
        if (bits == 16) quantize_row(1, x + m * xs, nb, (int16_t *)q + m * K, d + m * nb, ds + m * nb, 1);
        else quantize_row(0, x + m * xs, nb, (int8_t *)q + m * K, d + m * nb, ds + m * nb, 1);
    }
    return 0;
}

/* out [M, N] (row stride os) = qa(x) . dequant(w), activations of `bits` (8 or 16). Returns 0 on
 * success; 1 for an unknown type or width, K not a multiple of 32 or no memory. */
int quant_matmul_qa_f32(int bits, int qt, const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t M,
                        int64_t N, int64_t K, float *out, int64_t os) {
    if (!(qt == Q4_0 || qt == Q4_1 || qt == Q8_0) || bad_k(K) || (bits != 8 && bits != 16)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    const int64_t qbytes = M * K * (bits / 8);
    char *q = malloc((size_t)qbytes + 2 * (size_t)(M * nb) * sizeof(float));
    if (!q) return 1;
    float *dd = (float *)(q + qbytes); /* qbytes: a multiple of 32 */
    for (int64_t m = 0; m < M; m++) {
        if (bits == 16) quantize_row(1, x + m * xs, nb, (int16_t *)q + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
        else quantize_row(0, x + m * xs, nb, (int8_t *)q + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
    }
#pragma omp parallel if (M * N * K >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t units = (N + 7) / 8; /* contiguous ranges of 8-row multiples: each thread its own part of w */
        int64_t n0 = units * tid / nt * 8, n1 = units * (tid + 1) / nt * 8;
        n1 = n1 < N ? n1 : N;
        if (n0 < n1) { /* type and width compile-time constants in each instance */
#define QA_TYPES(WIDE)                                                                   \
    switch (qt) {                                                                        \
    case Q4_0: qa_path(Q4_0, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os); break;      \
    case Q4_1: qa_path(Q4_1, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os); break;      \
    default: qa_path(Q8_0, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os);               \
    }
            if (bits == 16) QA_TYPES(1) else QA_TYPES(0)
#undef QA_TYPES
        }
    }
    free(q);
    return 0;
}
