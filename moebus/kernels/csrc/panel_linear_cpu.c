/* A bf16 linear for few rows on vdpbf16ps: out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32
 * sums rounded to bf16 once, as kernels/panel_linear.py's reference (F.linear) does.
 *
 * The weight comes as kernels/lm_head_argmax.py's pack_panels lays bf16 out: panels of 16 output
 * rows, wp [N / 16][K / 2][16][2], a panel's 16 columns at one k pair in one 64-byte load, which
 * vdpbf16ps multiplies by a broadcast pair of x. Why a kernel of our own: at decode sizes (2-32
 * rows) oneDNN's packed GEMM reaches a fraction of the core's dot-product rate, and each weight is
 * read from memory once a step, cold; here a register tile holds R rows x C panels of accumulators
 * (more panels for fewer rows, so that each weight load feeds several products), the next panels are
 * prefetched while these are summed, and threads take groups of panels dynamically, so a thread
 * that loses its core for a while does not hold the others at the end of the call.
 *
 * Each row's sums run over k in the same order whatever M is: a row's result does not depend on
 * the other rows (batch invariance). Returns 1 (the caller falls back) for shapes outside it: K
 * not a multiple of 32, N not of 16, or a build without AVX512-BF16.
 */
#include "cpu_common.h"

#define NR 16   /* output columns a panel */
#define PR 32   /* bf16 a panel holds per k pair */
#define GROUP 4 /* panels a task: enough work to amortize the task, enough tasks to balance */
/* Rows a register tile: 12 rows x 2 panels is 24 accumulators, 2 weight loads and 12 broadcasts a
 * k pair. Measured against blocks of 16 rows on 1 panel (loadtest/ab_panel_linear.py, Zen 4): 16
 * rows 11.5 -> 10.3 ms, 64 rows 38.8 -> 33.8 (14 x 2 was no better). */
#define ROWS 12

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* out rows [0, rows) x C panels from R-row register tiles (rows past `rows` repeat the last row and
 * are not stored); the `pf_bytes` at pf (the next panels) are prefetched over the k loop. */
#define DEFINE_TILE(R, C)                                                                                   \
    static inline __attribute__((always_inline)) void tile_##R##x##C(                                      \
        const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t pstride, int K2, const float *bias,     \
        uint16_t *out, int64_t os, int rows, const char *pf, int64_t pf_bytes) {                           \
        __m512 acc[R][C];                                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                \
        const uint16_t *xr[R];                                                                              \
        for (int r = 0; r < R; r++) xr[r] = x + (r < rows ? r : rows - 1) * xs;                             \
        const int64_t step = (pf_bytes / K2 + 63) / 64 * 64;                                                \
        for (int i = 0; i < K2; i++) {                                                                      \
            if (pf)                                                                                         \
                for (int64_t o = 0; o < step; o += 64) __builtin_prefetch(pf + i * step + o, 0, 2);         \
            __m512bh w[C];                                                                                  \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                             \
                w[c] = (__m512bh)_mm512_loadu_si512(wp + c * pstride + i * PR);                             \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                          \
                int32_t pair;                                                                               \
                memcpy(&pair, xr[r] + 2 * i, sizeof pair);                                                  \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                       \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                         \
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);                                       \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < rows; r++)                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                           \
                const __m512 v = bias ? _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + c * NR)) : acc[r][c]; \
                _mm256_storeu_si256((__m256i *)(out + r * os + c * NR), (__m256i)_mm512_cvtneps_pbh(v));    \
            }                                                                                               \
    }
DEFINE_TILE(12, 2)
DEFINE_TILE(12, 1)
DEFINE_TILE(8, 2)
DEFINE_TILE(4, 4)
DEFINE_TILE(2, 4)
DEFINE_TILE(1, 4)

/* Panels [p0, p1) for one block of rows <= ROWS, in the widest tiles the row count allows. */
static void panels_rows(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t pstride, int K2,
                        const float *bias, uint16_t *out, int64_t os, int rows, int64_t p0, int64_t p1,
                        const char *pf, int64_t pf_bytes) {
    const int64_t pbytes = pstride * 2;
    int64_t p = p0;
#define RUN(R, C)                                                                                               \
    for (; p + C <= p1; p += C)                                                                                 \
        tile_##R##x##C(x, xs, wp + p * pstride, pstride, K2, bias ? bias + p * NR : 0, out + p * NR, os, rows, \
                       pf ? pf + (p - p0) * pbytes : 0, pf ? pf_bytes * C / (p1 - p0) : 0)
    if (rows > 8)
        RUN(12, 2);
    else if (rows > 4)
        RUN(8, 2);
    else if (rows > 2)
        RUN(4, 4);
    else if (rows > 1)
        RUN(2, 4);
    else
        RUN(1, 4);
    RUN(12, 1); /* what a wide tile left */
#undef RUN
}

int panel_linear_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const float *bias, int64_t M, int64_t N,
                      int64_t K, uint16_t *out, int64_t os) {
    if (K % 32 || N % NR || K <= 0 || N <= 0 || M <= 0) return 1;
    const int K2 = (int)(K / 2);
    const int64_t P = N / NR, pstride = (int64_t)K2 * PR;
    const int64_t tasks = (P + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(guided) if (M * N * K >= 262144)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t p0 = t * GROUP, p1 = p0 + GROUP < P ? p0 + GROUP : P;
        /* the next task's panels, fetched while the first row block runs: guided chunks are runs of
         * tasks, so the thread that prefetched them takes them next (with schedule(dynamic, 1) the
         * other thread often did, and a whole process ran at the speed of no prefetch: 16 rows 17.7
         * vs 11.7 ms); the chunks still shrink toward the end, so a thread that lost its core for a
         * while leaves the rest to the others */
        const int64_t q1 = p1 + GROUP < P ? p1 + GROUP : P;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
            const char *pf = m0 == 0 && p1 < P ? (const char *)(wp + p1 * pstride) : 0;
            panels_rows(x + m0 * xs, xs, wp, pstride, K2, bias, out + m0 * os, os, rows, p0, p1, pf,
                        (q1 - p1) * pstride * 2);
        }
    }
    return 0;
}
#else
int panel_linear_bf16(const uint16_t *x, int64_t xs, const uint16_t *wp, const float *bias, int64_t M, int64_t N,
                      int64_t K, uint16_t *out, int64_t os) {
    (void)x, (void)xs, (void)wp, (void)bias, (void)M, (void)N, (void)K, (void)out, (void)os;
    return 1;
}
#endif
