/* Greedy sampling fused into the LM head: out[m] = argmax_n round(x_m . w_n), the semantics of
 * kernels/lm_head_argmax.py's reference (torch's max(dim=1).indices of the logits in the storage
 * type: the first maximum, or the first NaN). x [M, K] with row stride xs (elements, last dim
 * contiguous); the weight comes packed in panels of 16 vocabulary rows, wp [P][K][16] (P = N / 16
 * rounded up, zero rows past N), so that a panel's 16 columns at one k are one contiguous load;
 * out [M] int64.
 *
 * The [M, N] logits are never written. Each thread takes a contiguous range of panels; per panel
 * it runs the x rows in 6 x 16 register tiles (12 accumulators: 2 weight loads and 6 broadcasts
 * per k) and folds each tile into lane-wise running bests (value, first index, first NaN) with
 * vector compares. Lanes and then thread ranges are merged so that ties go to the lowest index.
 * A row's result does not depend on the other rows in the call.
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

/* 16 logits of one tile row rounded to the storage type, folded into the row's lanes. */
INLINE void fold16(enum dtype t, const float *v, int32_t c0, int32_t n_valid, lanes_t *b) {
#pragma omp simd
    for (int l = 0; l < NR; l++) {
        const float x = l < n_valid ? round_to(t, v[l]) : -INFINITY;
        const int32_t i = c0 + l;
        const int nan = x != x;
        b->nan_idx[l] = nan && b->nan_idx[l] == INT32_MAX ? i : b->nan_idx[l];
        const int better = x > b->val[l];
        b->val[l] = better ? x : b->val[l];
        b->idx[l] = better ? i : b->idx[l];
    }
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

/* Panels [p0, p1) against every x row (xf: M float32 rows of K). */
INLINE void argmax_panels(enum dtype t, int es, const float *xf, int64_t M, int K, const char *wp, int64_t N,
                          int64_t p0, int64_t p1, lanes_t *best) {
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
            for (int r = 0; r < rows; r++) fold16(t, out[r], c0, n_valid, best + m0 + r);
        }
    }
}

INLINE int lm_head_argmax_impl(enum dtype t, int es, const char *x, int64_t xs, const char *wp, int64_t M, int64_t N,
                               int K, int64_t *out) {
    if (M <= 0) return 0;
    if (N <= 0 || N >= INT32_MAX - NR) return 1;
    const int nt_max = omp_get_max_threads();
    float *xf = malloc(((size_t)M * K + 1) * sizeof(float));
    lanes_t *best = malloc((size_t)nt_max * M * sizeof(lanes_t));
    int *used = calloc((size_t)nt_max, sizeof(int));
    if (!xf || !best || !used) {
        free(xf), free(best), free(used);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) load_row(t, xf + m * K, x + m * xs * es, K);
    const int64_t P = (N + NR - 1) / NR;
#pragma omp parallel if (M * N * (int64_t)K >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = P * tid / nt, p1 = P * (tid + 1) / nt;
        lanes_t *mine = best + (int64_t)tid * M;
        if (p0 < p1) {
            used[tid] = 1;
            for (int64_t m = 0; m < M; m++)
                for (int l = 0; l < NR; l++) mine[m].val[l] = -INFINITY, mine[m].idx[l] = INT32_MAX,
                                             mine[m].nan_idx[l] = INT32_MAX;
            WITH_DTYPE(t, argmax_panels(t_, es_, xf, M, K, wp, N, p0, p1, mine));
        }
    }
    for (int64_t m = 0; m < M; m++) {
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
    free(xf), free(best), free(used);
    return 0;
}

/* Returns 0 on success, 1 when out of memory or N is out of range (the caller falls back). */
#define DEFINE_LM_HEAD_ARGMAX(SUFFIX, DT, ES)                                                               \
    int lm_head_argmax_##SUFFIX(const void *x, int64_t xs, const void *wp, int64_t M, int64_t N, int K,     \
                                int64_t *out) {                                                              \
        return lm_head_argmax_impl(DT, ES, (const char *)x, xs, (const char *)wp, M, N, K, out);            \
    }

DEFINE_LM_HEAD_ARGMAX(f32, F32, 4)
DEFINE_LM_HEAD_ARGMAX(bf16, BF16, 2)
DEFINE_LM_HEAD_ARGMAX(f16, F16, 2)
