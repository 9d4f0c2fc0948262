/* Fused MoE MLP for decode-sized batches on CPU; kernels/fused_moe.py's fused_moe_ref is the spec.
 * x [T, D] (row stride xs), w13 [E, 2I, D] and w2 [E, D, I] contiguous, topk_weights [T, k]
 * float32 and topk_ids [T, k] int64 contiguous, out [T, D] contiguous. The T*k assignments are
 * grouped by expert and each expert is one task that streams every weight row once and dots it
 * with the rows of all tokens routed there in 2 x 4 register tiles (cpu_dot.h). Matmul outputs
 * are rounded to the storage type as the reference's unfused GEMMs are; the k-slot combine sums
 * in float32. The win over the reference is the ~6 torch ops per expert it saves and the tiles, so
 * callers use it for decode-sized batches, and at any size for cache-sized experts (large experts
 * at prefill sizes are GEMM-bound and take torch's GEMMs).
 */
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_dot.h"

/* One expert's n assignments (rows[j]: its token's float32 row; yrow[j]: its row of y; h[j]: its
 * [gate | up] scratch row of 2I). */
INLINE void expert_task(enum dtype t, int es, const char *w13, const char *w2, const float *const *rows,
                        float *const *yrow, float *const *h, int n, int D, int I, int has_limit, float limit) {
    dots_rows(t, es, w13, (int64_t)D * es, 2 * I, rows, n, D, h); /* h[j] = W13 x */
    for (int j = 0; j < n; j++) { /* act = silu(min(gate, limit)) * clamp(up, -limit, limit) */
        float *g = h[j], *u = g + I;
#pragma omp simd
        for (int i = 0; i < I; i++) {
            const float gi = has_limit ? min_hi(g[i], limit) : g[i];
            const float ui = has_limit ? clamp_lo_hi(u[i], -limit, limit) : u[i];
            g[i] = round_to(t, gi / (1.f + fast_exp(-gi)) * ui);
        }
    }
    dots_rows(t, es, w2, (int64_t)I * es, D, (const float *const *)h, n, I, yrow); /* y = W2 act */
}

INLINE int fused_moe_impl(enum dtype t, int es, const char *x, int64_t xs, const char *w13, const char *w2,
                          const float *tw, const int64_t *ids, char *out, int T, int k, int E, int D, int I,
                          int has_limit, float limit) {
    const int A = T * k;
    int *start = calloc((size_t)E + 1, sizeof(int)), *fill = malloc(((size_t)E + 1) * sizeof(int));
    int *order = malloc(((size_t)A + 1) * sizeof(int));
    float *xf = malloc(((size_t)T * D + 1) * sizeof(float)), *y = malloc(((size_t)A * D + 1) * sizeof(float));
    int status = !(start && fill && order && xf && y);
    for (int a = 0; !status && a < A; a++) {
        if (ids[a] < 0 || ids[a] >= E) status = 2;
        else start[ids[a] + 1]++;
    }
    if (status) goto done;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, (size_t)E * sizeof(int));
    for (int a = 0; a < A; a++) order[fill[ids[a]]++] = a; /* grouped by expert, stable */
#pragma omp parallel for schedule(static)
    for (int tok = 0; tok < T; tok++) load_row(t, xf + (int64_t)tok * D, x + (int64_t)tok * xs * es, D);
#pragma omp parallel
    {
        float *hbuf = NULL;
        const float **rows = malloc(((size_t)A + 1) * sizeof(float *));
        float **yrow = malloc(((size_t)A + 1) * sizeof(float *)), **h = malloc(((size_t)A + 1) * sizeof(float *));
        int h_rows = 0;
#pragma omp for schedule(dynamic, 1)
        for (int e = 0; e < E; e++) {
            const int s = start[e], n = start[e + 1] - s;
            if (n == 0) continue;
            if (n > h_rows) {
                free(hbuf);
                hbuf = malloc((size_t)n * 2 * I * sizeof(float));
                h_rows = hbuf ? n : 0;
            }
            if (!hbuf || !rows || !yrow || !h) { /* an expert left out: the caller falls back */
#pragma omp atomic write
                status = 1;
                continue;
            }
            for (int j = 0; j < n; j++) {
                const int a = order[s + j];
                rows[j] = xf + (int64_t)(a / k) * D;
                yrow[j] = y + (int64_t)a * D;
                h[j] = hbuf + (int64_t)j * 2 * I;
            }
            WITH_DTYPE(t, expert_task(t_, es_, w13 + (int64_t)e * 2 * I * D * es_, w2 + (int64_t)e * D * I * es_, rows,
                                      yrow, h, n, D, I, has_limit, limit));
        }
        free(hbuf), free(rows), free(yrow), free(h);
    }
    if (status) goto done;
#pragma omp parallel for schedule(static)
    for (int tok = 0; tok < T; tok++) { /* out[t] = sum_j w[t, j] y[t, j], in float32 */
        float acc[8192];
        for (int d0 = 0; d0 < D; d0 += 8192) {
            const int n = D - d0 < 8192 ? D - d0 : 8192;
            memset(acc, 0, (size_t)n * sizeof(float));
            for (int j = 0; j < k; j++) {
                const float w = tw[tok * k + j], *yr = y + ((int64_t)tok * k + j) * D + d0;
#pragma omp simd
                for (int d = 0; d < n; d++) acc[d] += w * yr[d];
            }
            store_row(t, out + ((int64_t)tok * D + d0) * es, acc, 1.f, n);
        }
    }
done:
    free(start), free(fill), free(order), free(xf), free(y);
    return status;
}

/* Returns 0 on success, 1 when out of memory, 2 for an expert id outside [0, E) (caller falls back
 * to the reference, which raises). */
#define DEFINE_FUSED_MOE(SUFFIX, DT, ES)                                                                       \
    int fused_moe_##SUFFIX(const void *x, int64_t xs, const void *w13, const void *w2, const float *tw,        \
                           const int64_t *ids, void *out, int T, int k, int E, int D, int I, int has_limit,    \
                           float limit) {                                                                      \
        return fused_moe_impl(DT, ES, (const char *)x, xs, (const char *)w13, (const char *)w2, tw, ids,        \
                              (char *)out, T, k, E, D, I, has_limit, limit);                                   \
    }

DEFINE_FUSED_MOE(f32, F32, 4)
DEFINE_FUSED_MOE(bf16, BF16, 2)
DEFINE_FUSED_MOE(f16, F16, 2)
