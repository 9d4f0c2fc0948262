/* The LM head on packed panels, in float32 (the logits are never rounded to the storage type):
 * lm_head_argmax: out[m] = argmax_n (x_m . w_n), the semantics of kernels/lm_head_argmax.py's
 * reference (torch's max(dim=1).indices of the float32 logits: the first maximum, or the first
 * NaN), without writing the [M, N] logits; lm_head_logits: those float32 logits, for sampling and
 * logprobs. x [M, K] with row stride xs (elements, last dim contiguous); the weight comes packed in
 * panels of 16 vocabulary rows, wp [P][K][16] (P = N / 16 rounded up, zero rows past N), so that a
 * panel's 16 columns at one k are one contiguous load.
 *
 * Each thread takes a contiguous range of panels; per panel it runs the x rows in 6 x 16 register
 * tiles (12 accumulators: 2 weight loads and 6 broadcasts per k) and either stores each tile's
 * sums or folds them into lane-wise running bests (value, first index, first NaN) with vector
 * compares. Lanes and then thread ranges are merged so that ties go to the lowest index. A row's
 * result does not depend on the other rows in the call.
 *
 * bf16 weights come in k pairs instead, wp [P][Kp/2][16][2] (Kp = K rounded up to 32, zeros past
 * K): the layout of AMX's B tiles and of vdpbf16ps's pair products. Three paths read it: AMX tiles
 * (16 x 16 x 32 products an instruction), AVX512-BF16's vdpbf16ps, and float32 FMA tiles as the
 * other types have (AVX-512, AVX2 or scalar); `isa` picks one for tests and A/B runs (0: the best
 * one here).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_dot.h"

#define NR 16 /* vocabulary rows per panel */
#define MR 6  /* x rows per register tile */

typedef struct {
    float val[NR];
    int32_t idx[NR], nan_idx[NR]; /* nan_idx INT32_MAX: no NaN seen in this lane */
} lanes_t;

/* 16 float32 logits of one tile row, folded into the row's lanes. */
INLINE void fold16(const float *v, int32_t c0, int32_t n_valid, lanes_t *b) {
#pragma omp simd
    for (int l = 0; l < NR; l++) {
        const float x = l < n_valid ? v[l] : -INFINITY;
        const int32_t i = c0 + l;
        const int nan = x != x;
        b->nan_idx[l] = nan && b->nan_idx[l] == INT32_MAX ? i : b->nan_idx[l];
        const int better = x > b->val[l];
        b->val[l] = better ? x : b->val[l];
        b->idx[l] = better ? i : b->idx[l];
    }
}

/* Where a tile's sums go: stored as float32 logits (logits != NULL, ls floats a row), or folded
 * into `best` (the thread's lanes, one per x row). */
typedef struct {
    lanes_t *best;
    float *logits;
    int64_t ls;
} sink_t;

INLINE void emit(sink_t s, const float *v, int32_t c0, int32_t n_valid, int64_t m) {
    if (s.logits)
        memcpy(s.logits + m * s.ls + c0, v, (size_t)n_valid * sizeof(float));
    else
        fold16(v, c0, n_valid, s.best + m);
}

#if MOEBUS_DOT_AVX2
/* acc rows r < MR of the tile at rows a[r] (K floats each), panel p (K x 16). */
INLINE void tile(enum dtype t, int es, const float *const a[MR], const char *panel, int K, float out[MR][NR]) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const char *pk = panel + (int64_t)k * NR * es;
        const __m256 b0 = load8(t, pk), b1 = load8(t, pk + 8 * es);
        for (int r = 0; r < MR; r++) {
            const __m256 x = _mm256_broadcast_ss(a[r] + k);
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r][0]), _mm256_storeu_ps(out[r] + 8, acc[r][1]);
}
#else
INLINE void tile(enum dtype t, int es, const float *const a[MR], const char *panel, int K, float out[MR][NR]) {
    for (int r = 0; r < MR; r++)
        for (int l = 0; l < NR; l++) out[r][l] = 0.f;
    for (int k = 0; k < K; k++) {
        float w[NR];
        load_row(t, w, panel + (int64_t)k * NR * es, NR);
        for (int r = 0; r < MR; r++)
#pragma omp simd
            for (int l = 0; l < NR; l++) out[r][l] += a[r][k] * w[l];
    }
}
#endif

#if defined(__AVX512F__)
#define HAVE_FMA512 1
#define MRW 16 /* x rows an AVX-512 tile: a panel is one register, 16 accumulators */
/* The same dots 16 lanes wide (a lane's k order as in tile(), so the same sums). */
INLINE void tile16(enum dtype t, int es, const float *const a[MRW], const char *panel, int K, float out[MRW][NR]) {
    __m512 acc[MRW];
    for (int r = 0; r < MRW; r++) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const char *pk = panel + (int64_t)k * NR * es;
        const __m512 b = t == F32 ? _mm512_loadu_ps((const float *)pk) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pk));
        for (int r = 0; r < MRW; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][k]), b, acc[r]);
    }
    for (int r = 0; r < MRW; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#else
#define HAVE_FMA512 0
#endif

/* Panels [p0, p1) against every x row (xf: M float32 rows of K); wide: AVX-512 tiles where built
 * (f32 and f16 only; bf16 has its own panels below). */
INLINE void argmax_panels(enum dtype t, int es, int wide, const float *xf, int64_t M, int K, const char *wp,
                          int64_t N, int64_t p0, int64_t p1, sink_t s) {
#if HAVE_FMA512
    if (wide && t != BF16) {
        float out[MRW][NR];
        for (int64_t p = p0; p < p1; p++) {
            const char *panel = wp + p * K * NR * es;
            const int32_t c0 = (int32_t)(p * NR);
            const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
            for (int64_t m0 = 0; m0 < M; m0 += MRW) {
                const float *a[MRW];
                const int rows = M - m0 < MRW ? (int)(M - m0) : MRW;
                for (int r = 0; r < MRW; r++) a[r] = xf + (m0 + (r < rows ? r : rows - 1)) * K;
                tile16(t, es, a, panel, K, out);
                for (int r = 0; r < rows; r++) emit(s, out[r], c0, n_valid, m0 + r);
            }
        }
        return;
    }
#endif
    (void)wide;
    float out[MR][NR];
    for (int64_t p = p0; p < p1; p++) {
        const char *panel = wp + p * K * NR * es;
        const int32_t c0 = (int32_t)(p * NR);
        const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const float *a[MR];
            const int rows = M - m0 < MR ? (int)(M - m0) : MR;
            for (int r = 0; r < MR; r++) a[r] = xf + (m0 + (r < rows ? r : rows - 1)) * K;
            tile(t, es, a, panel, K, out);
            for (int r = 0; r < rows; r++) emit(s, out[r], c0, n_valid, m0 + r);
        }
    }
}

/* ---- bf16 on k-pair panels ---- */
#define KP_ALIGN 32 /* bf16 panels and x rows padded in K to whole AMX tiles (32 bf16 a row) */
#define PR 32       /* bf16 elements a panel holds per k pair: 16 columns x 2 */
/* Paths (`isa`): FMA: float32 FMA tiles, AVX-512 where built; FMA256: the AVX2 (or scalar) ones. */
enum { ISA_AUTO = 0, ISA_FMA = 1, ISA_AVX512BF16 = 2, ISA_AMX = 3, ISA_FMA256 = 4 };

/* Float32 FMA tiles on the pair layout (MR rows of xf, Kx floats each, zero past K): k then k + 1
 * into the same accumulator, the order of tile(). */
INLINE void tile_pairs(const float *const a[MR], const uint16_t *panel, int K2, float out[MR][NR]) {
#if MOEBUS_DOT_AVX2
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < K2; i++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(panel + i * PR)),
                      w1 = _mm256_loadu_si256((const __m256i *)(panel + i * PR + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
        for (int r = 0; r < MR; r++) {
            const __m256 xe = _mm256_broadcast_ss(a[r] + 2 * i), xo = _mm256_broadcast_ss(a[r] + 2 * i + 1);
            acc[r][0] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, acc[r][1]));
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out[r], acc[r][0]), _mm256_storeu_ps(out[r] + 8, acc[r][1]);
#else
    for (int r = 0; r < MR; r++)
        for (int l = 0; l < NR; l++) out[r][l] = 0.f;
    for (int i = 0; i < K2; i++)
        for (int r = 0; r < MR; r++)
            for (int l = 0; l < NR; l++) {
                out[r][l] += a[r][2 * i] * bf16_to_f32(panel[i * PR + 2 * l]);
                out[r][l] += a[r][2 * i + 1] * bf16_to_f32(panel[i * PR + 2 * l + 1]);
            }
#endif
}

#if HAVE_FMA512
/* tile_pairs 16 lanes wide: a panel's k pair is one register, its even and odd halves widened. */
INLINE void tile_pairs16(const float *const a[MRW], const uint16_t *panel, int K2, float out[MRW][NR]) {
    __m512 acc[MRW];
    for (int r = 0; r < MRW; r++) acc[r] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < K2; i++) {
        const __m512i w = _mm512_loadu_si512(panel + i * PR);
        const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), o = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
        for (int r = 0; r < MRW; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][2 * i + 1]), o,
                                     _mm512_fmadd_ps(_mm512_set1_ps(a[r][2 * i]), e, acc[r]));
    }
    for (int r = 0; r < MRW; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#define MRD 16 /* x rows a vdpbf16ps tile: 16 accumulators, one weight load and 16 broadcasts a k pair */
/* out[r] = a[r] . panel for MRD rows of bf16 x (Kx elements, zero past K). */
INLINE void tile_dpbf16(const uint16_t *const a[MRD], const uint16_t *panel, int K2, float out[MRD][NR]) {
    __m512 acc[MRD];
    for (int r = 0; r < MRD; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < K2; i++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + i * PR);
        for (int r = 0; r < MRD; r++) {
            int32_t pair;
            memcpy(&pair, a[r] + 2 * i, sizeof pair);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    for (int r = 0; r < MRD; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#else
#define HAVE_DPBF16 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_common.h"
#define HAVE_AMX 1

/* Tiles 0-3 accumulate 2 row blocks x 2 panels, 4-5 hold x's row blocks, 6-7 the panels' k pairs:
 * all 16 rows of 64 bytes. Per thread: the configuration is thread state. */
static void amx_configure(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* out[b][j] (16 x 16 each) = x rows [m0 + 16 (b / 2), +16) . panel (b % 2) for 2 row blocks and
 * panels q0, q1 (K2 k pairs each); xb is Mx x Kx bf16, zero padded. */
INLINE void amx_block(const uint16_t *xb, int Kx, int64_t m0, const uint16_t *q0, const uint16_t *q1, int K2,
                      float out[4][16][NR]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *x0 = xb + m0 * Kx, *x1 = xb + (m0 + 16) * Kx;
    for (int i = 0; i < K2; i += 16) { /* 32 k a step */
        _tile_loadd(4, x0 + 2 * i, Kx * 2);
        _tile_loadd(5, x1 + 2 * i, Kx * 2);
        _tile_loadd(6, q0 + i * PR, PR * 2);
        _tile_loadd(7, q1 + i * PR, PR * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out[0], NR * 4);
    _tile_stored(1, out[1], NR * 4);
    _tile_stored(2, out[2], NR * 4);
    _tile_stored(3, out[3], NR * 4);
}
#else
#define HAVE_AMX 0
static int amx_permitted(void) { return 0; }
#endif

/* The path `isa` asks for for dtype t (0: the best one here), or -1 when it is not available. Auto:
 * AMX, else vdpbf16ps, else the FMA tiles. On Zen 4 (no AMX) vdpbf16ps wins at every size (2 threads,
 * x 576 x 49152: 1 row 2.28 vs 4.44 ms, 16 rows 4.98 vs 6.04, 64 rows 11.8 vs 19.5, 128 rows 20.0
 * vs 36.4). A Sapphire Rapids core, which always takes AMX here, ran it slower than the FMA tiles at
 * 16 rows (23.8 vs 15.5 ms; 34.7 vs 38.9 ms at 64 rows, AMX 5.1 / 7.8 ms). */
static int pick_isa(enum dtype t, int isa) {
    const int amx = t == BF16 && HAVE_AMX && amx_permitted();
    if (isa == ISA_AUTO) return amx ? ISA_AMX : t == BF16 && HAVE_DPBF16 ? ISA_AVX512BF16 : ISA_FMA;
    if (isa == ISA_FMA || isa == ISA_FMA256 || (isa == ISA_AVX512BF16 && t == BF16 && HAVE_DPBF16) ||
        (isa == ISA_AMX && amx))
        return isa;
    return -1;
}

/* Bit i set: path i can run here for dtype t (0 f32, 1 bf16, 2 f16). */
int lm_head_argmax_isas(int t) {
    int bits = 0;
    for (int i = ISA_FMA; i <= ISA_FMA256; i++) bits |= (pick_isa((enum dtype)t, i) == i) << i;
    return bits;
}

/* Panels [p0, p1) of bf16 k-pair panels (Kx / 2 pairs each) against every x row: xf (float32, for
 * the FMA paths) or xb (bf16, Mx rows) as the path needs. */
static void argmax_panels_bf16(int isa, const float *xf, const uint16_t *xb, int64_t M, int Kx, const char *wpc,
                               int64_t N, int64_t p0, int64_t p1, sink_t s) {
    (void)isa; /* read only where AMX / AVX-512 paths are built */
    const uint16_t *wp = (const uint16_t *)wpc;
    const int K2 = Kx / 2;
    const int64_t ps = (int64_t)K2 * PR; /* elements a panel */
#if HAVE_AMX
    if (isa == ISA_AMX) {
        float out[4][16][NR];
        amx_configure();
        for (int64_t p = p0; p < p1; p += 2) {
            const int64_t q = p + 1 < p1 ? p + 1 : p; /* an odd last panel runs twice, folded once */
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                amx_block(xb, Kx, m0, wp + p * ps, wp + q * ps, K2, out);
                for (int b = 0; b < 4; b++) {
                    const int64_t pp = b % 2 ? q : p, mb = m0 + 16 * (b / 2);
                    if (b % 2 && q == p) continue;
                    const int32_t c0 = (int32_t)(pp * NR);
                    const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
                    for (int r = 0; r < 16 && mb + r < M; r++) emit(s, out[b][r], c0, n_valid, mb + r);
                }
            }
        }
        _tile_release();
        return;
    }
#endif
#if HAVE_DPBF16
    if (isa == ISA_AVX512BF16) {
        float out[MRD][NR];
        for (int64_t p = p0; p < p1; p++) {
            const int32_t c0 = (int32_t)(p * NR);
            const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
            for (int64_t m0 = 0; m0 < M; m0 += MRD) {
                const uint16_t *a[MRD];
                const int rows = M - m0 < MRD ? (int)(M - m0) : MRD;
                for (int r = 0; r < MRD; r++) a[r] = xb + (m0 + (r < rows ? r : rows - 1)) * Kx;
                tile_dpbf16(a, wp + p * ps, K2, out);
                for (int r = 0; r < rows; r++) emit(s, out[r], c0, n_valid, m0 + r);
            }
        }
        return;
    }
#endif
    (void)xb;
#if HAVE_FMA512
    if (isa == ISA_FMA) {
        float out[MRW][NR];
        for (int64_t p = p0; p < p1; p++) {
            const int32_t c0 = (int32_t)(p * NR);
            const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
            for (int64_t m0 = 0; m0 < M; m0 += MRW) {
                const float *a[MRW];
                const int rows = M - m0 < MRW ? (int)(M - m0) : MRW;
                for (int r = 0; r < MRW; r++) a[r] = xf + (m0 + (r < rows ? r : rows - 1)) * Kx;
                tile_pairs16(a, wp + p * ps, K2, out);
                for (int r = 0; r < rows; r++) emit(s, out[r], c0, n_valid, m0 + r);
            }
        }
        return;
    }
#endif
    float out[MR][NR];
    for (int64_t p = p0; p < p1; p++) {
        const int32_t c0 = (int32_t)(p * NR);
        const int32_t n_valid = N - c0 < NR ? (int32_t)(N - c0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const float *a[MR];
            const int rows = M - m0 < MR ? (int)(M - m0) : MR;
            for (int r = 0; r < MR; r++) a[r] = xf + (m0 + (r < rows ? r : rows - 1)) * Kx;
            tile_pairs(a, wp + p * ps, K2, out);
            for (int r = 0; r < rows; r++) emit(s, out[r], c0, n_valid, m0 + r);
        }
    }
}

/* The head's float32 sums of every x row against panels [0, P): into `logits` (ls floats a row)
 * where it is given, else folded to out[m], the first maximum of row m (or its first NaN). */
INLINE int lm_head_impl(enum dtype t, int es, const char *x, int64_t xs, const char *wp, int64_t M, int64_t N, int K,
                        int isa, int64_t *out, float *logits, int64_t ls) {
    if (M <= 0) return 0;
    if (N <= 0 || N >= INT32_MAX - NR) return 1;
    isa = pick_isa(t, isa);
    if (isa < 0) return 1;
    const int nt_max = omp_get_max_threads();
    const int Kx = t == BF16 ? (K + KP_ALIGN - 1) / KP_ALIGN * KP_ALIGN : K; /* x rows padded with zeros */
    const int64_t Mx = (M + 31) / 32 * 32;                                  /* AMX: whole pairs of 16-row blocks */
    float *xf = calloc((size_t)M * Kx + 1, sizeof(float));
    const int wants_xb = isa == ISA_AMX || isa == ISA_AVX512BF16;
    uint16_t *xb = wants_xb ? calloc((size_t)Mx * Kx, sizeof(uint16_t)) : NULL;
    lanes_t *best = logits ? NULL : malloc((size_t)nt_max * M * sizeof(lanes_t));
    int *used = calloc((size_t)nt_max, sizeof(int));
    if (!xf || (!logits && !best) || !used || (wants_xb && !xb)) {
        free(xf), free(best), free(used), free(xb);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) load_row(t, xf + m * Kx, x + m * xs * es, K);
    if (xb)
        for (int64_t m = 0; m < M; m++) memcpy(xb + m * Kx, x + m * xs * es, (size_t)K * 2);
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel if (M * N * (int64_t)K >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = P * tid / nt, p1 = P * (tid + 1) / nt;
        const sink_t sink = {logits ? NULL : best + (int64_t)tid * M, logits, ls};
        if (p0 < p1) {
            used[tid] = 1;
            for (int64_t m = 0; m < M && sink.best; m++)
                for (int l = 0; l < NR; l++) sink.best[m].val[l] = -INFINITY, sink.best[m].idx[l] = INT32_MAX,
                                             sink.best[m].nan_idx[l] = INT32_MAX;
            if (t == BF16)
                argmax_panels_bf16(isa, xf, xb, M, Kx, wp, N, p0, p1, sink);
            else
                WITH_DTYPE(t, argmax_panels(t_, es_, isa == ISA_FMA, xf, M, K, wp, N, p0, p1, sink));
        }
    }
    for (int64_t m = 0; m < M && best; m++) {
        /* Greatest value, lowest index among equals; a lane never improved (all -inf) still holds
         * INT32_MAX, so an all -inf row falls back to 0 as torch gives. */
        float bv = -INFINITY;
        int32_t bi = INT32_MAX, ni = INT32_MAX;
        for (int i = 0; i < nt_max; i++) {
            if (!used[i]) continue;
            const lanes_t *b = best + (int64_t)i * M + m;
            for (int l = 0; l < NR; l++) {
                if (b->val[l] > bv || (b->val[l] == bv && b->idx[l] < bi)) bv = b->val[l], bi = b->idx[l];
                ni = b->nan_idx[l] < ni ? b->nan_idx[l] : ni;
            }
        }
        out[m] = ni != INT32_MAX ? ni : bi != INT32_MAX ? bi : 0;
    }
    free(xf), free(best), free(used), free(xb);
    return 0;
}

/* Return 0 on success, 1 when out of memory, N is out of range or the path `isa` cannot run here
 * for this dtype (the caller falls back). lm_head_logits writes out [M, N] float32, row stride os. */
#define DEFINE_LM_HEAD(SUFFIX, DT, ES)                                                                      \
    int lm_head_argmax_##SUFFIX(const void *x, int64_t xs, const void *wp, int64_t M, int64_t N, int K,     \
                                int isa, int64_t *out) {                                                     \
        return lm_head_impl(DT, ES, (const char *)x, xs, (const char *)wp, M, N, K, isa, out, NULL, 0);     \
    }                                                                                                        \
    int lm_head_logits_##SUFFIX(const void *x, int64_t xs, const void *wp, int64_t M, int64_t N, int K,     \
                                int isa, float *out, int64_t os) {                                           \
        return lm_head_impl(DT, ES, (const char *)x, xs, (const char *)wp, M, N, K, isa, NULL, out, os);     \
    }

DEFINE_LM_HEAD(f32, F32, 4)
DEFINE_LM_HEAD(bf16, BF16, 2)
DEFINE_LM_HEAD(f16, F16, 2)
