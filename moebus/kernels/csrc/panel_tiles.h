/* The register tiles of the panel kernels (panel_linear_cpu.c, fused_moe_panels_cpu.c): out rows x
 * panels of 16 output columns from a weight packed by kernels/lm_head_argmax.py's pack_panels; see
 * panel_linear_cpu.c for the layout and why. Each row's sums run over k in the same order whatever
 * the other rows are (batch invariance). */
#ifndef MOEBUS_PANEL_TILES_H
#define MOEBUS_PANEL_TILES_H
#include "cpu_common.h"

#define NR 16   /* output columns a panel */
#define GROUP 4 /* panels a task: enough work to amortize the task, enough tasks to balance */
/* Rows a register tile: 12 rows x 2 panels is 24 accumulators, 2 weight loads and 12 broadcasts a
 * step. Measured against blocks of 16 rows on 1 panel (bf16, loadtest/ab_panel_linear.py, Zen 4):
 * 16 rows 11.5 -> 10.3 ms, 64 rows 38.8 -> 33.8 (14 x 2 was no better). */
#define ROWS 12

#if defined(__AVX512F__)
#include <immintrin.h>

/* What differs between the types: the x operand of a step, the multiply-add, the store of 16 sums. */
#define A_f32(p) _mm512_set1_ps(*(const float *)(p))
#define MAC_f32(acc, a, w) _mm512_fmadd_ps(a, _mm512_castsi512_ps(w), acc)
#define STORE_f32(dst, v) _mm512_storeu_ps((float *)(dst), v)
typedef __m512 a_f32;
#if defined(__AVX512BF16__)
static inline __m512bh a_pair(const char *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}
#define A_bf16(p) a_pair(p)
#define MAC_bf16(acc, a, w) _mm512_dpbf16_ps(acc, a, (__m512bh)(w))
#define STORE_bf16(dst, v) _mm256_storeu_si256((__m256i *)(dst), (__m256i)_mm512_cvtneps_pbh(v))
typedef __m512bh a_bf16;
/* bf16 in, float32 sums out unrounded: an LM head's logits */
#define A_bf16f(p) a_pair(p)
#define MAC_bf16f(acc, a, w) _mm512_dpbf16_ps(acc, a, (__m512bh)(w))
#define STORE_bf16f(dst, v) _mm512_storeu_ps((float *)(dst), v)
typedef __m512bh a_bf16f;
#endif

/* Of the next task's `all` bytes of panels, the slice [return, return + *n) that the row block
 * [m0, m0 + rows) of a task's M rows prefetches: every block fetches its share, in proportion to
 * its rows, so the fetch overlaps the whole task. Fetched by the first block alone (the layout
 * before), it came in a burst faster than memory delivers and the later blocks overlapped nothing:
 * bf16, SmolLM2's layer shapes x 30, 2 threads, 20 alternating rounds (Zen 4): 32 rows 12.5 -> 10.7
 * ms, 64 rows 19.3 -> 18.1 (16 rows within 2%). */
static inline int64_t pf_slice(int64_t all, int64_t m0, int64_t rows, int64_t M, int64_t *n) {
    const int64_t o = all * m0 / M / 64 * 64;
    *n = all * (m0 + rows) / M / 64 * 64 - o;
    return o;
}

/* out rows [0, rows) x C panels from R-row register tiles (rows past `rows` repeat the last row and
 * are not stored); the `pf_bytes` at pf (the next panels) are prefetched over the k loop. Strides
 * in bytes; ES is the output element size. */
#define DEFINE_TILE(T, ES, R, C)                                                                            \
    static inline __attribute__((always_inline)) void tile_##T##_##R##x##C(                                \
        const char *x, int64_t xs, const char *wp, int64_t pstride, int steps, const float *bias,          \
        char *out, int64_t os, int rows, const char *pf, int64_t pf_bytes) {                               \
        __m512 acc[R][C];                                                                                   \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                \
        const char *xr[R];                                                                                  \
        for (int r = 0; r < R; r++) xr[r] = x + (r < rows ? r : rows - 1) * xs;                             \
        const int64_t ahead = (pf_bytes / steps + 63) / 64 * 64;                                            \
        for (int i = 0; i < steps; i++) {                                                                   \
            if (pf)                                                                                         \
                for (int64_t o = 0; o < ahead; o += 64) __builtin_prefetch(pf + i * ahead + o, 0, 2);       \
            __m512i w[C];                                                                                   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                             \
                w[c] = _mm512_loadu_si512(wp + c * pstride + i * 64);                                       \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                          \
                const a_##T a = A_##T(xr[r] + 4 * i);                                                       \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = MAC_##T(acc[r][c], a, w[c]); \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < rows; r++)                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                             \
                STORE_##T(out + r * os + c * NR * ES,                                                       \
                          bias ? _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + c * NR)) : acc[r][c]);     \
    }

/* Panels [p0, p1) for one block of rows <= ROWS, in the widest tiles the row count allows. */
#define DEFINE_PANELS_ROWS(T, ES)                                                                           \
    DEFINE_TILE(T, ES, 12, 2)                                                                               \
    DEFINE_TILE(T, ES, 12, 1)                                                                               \
    DEFINE_TILE(T, ES, 8, 2)                                                                                \
    DEFINE_TILE(T, ES, 4, 4)                                                                                \
    DEFINE_TILE(T, ES, 2, 4)                                                                                \
    DEFINE_TILE(T, ES, 1, 4)                                                                                \
    static void panels_rows_##T(const char *x, int64_t xs, const char *wp, int64_t pstride, int steps,      \
                                const float *bias, char *out, int64_t os, int rows, int64_t p0, int64_t p1, \
                                const char *pf, int64_t pf_bytes) {                                         \
        int64_t p = p0;                                                                                     \
        if (rows > 8)                                                                                       \
            RUN(T, ES, 12, 2);                                                                              \
        else if (rows > 4)                                                                                  \
            RUN(T, ES, 8, 2);                                                                               \
        else if (rows > 2)                                                                                  \
            RUN(T, ES, 4, 4);                                                                               \
        else if (rows > 1)                                                                                  \
            RUN(T, ES, 2, 4);                                                                               \
        else                                                                                                \
            RUN(T, ES, 1, 4);                                                                               \
        RUN(T, ES, 12, 1); /* what a wide tile left */                                                      \
    }
#define RUN(T, ES, R, C)                                                                                         \
    for (; p + C <= p1; p += C)                                                                                  \
    tile_##T##_##R##x##C(x, xs, wp + p * pstride, pstride, steps, bias ? bias + p * NR : 0, out + p * NR * ES, os, \
                         rows, pf ? pf + pf_bytes * (p - p0) / (p1 - p0) : 0, pf ? pf_bytes * C / (p1 - p0) : 0)

#endif /* __AVX512F__ */
#endif
