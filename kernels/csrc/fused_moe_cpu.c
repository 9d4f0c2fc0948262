/* Fused MoE MLP for decode-sized batches on CPU; kernels/fused_moe.py's fused_moe_ref is the spec.
 * x [T, D] (row stride xs), w13 [E, 2I, D] and w2 [E, D, I] contiguous, topk_weights [T, k]
 * float32 and topk_ids [T, k] int64 contiguous, out [T, D] contiguous. The T*k assignments are
 * grouped by expert and each expert is one task that streams every weight row once and dots it
 * with the rows of all tokens routed there (a GEMM with few rows, as decode gives). Matmul outputs
 * are rounded to the storage type as the reference's unfused GEMMs are; the k-slot combine sums
 * in float32. The win over the reference is the ~6 torch ops per expert it saves, so callers use
 * this for small T only (prefill-sized batches are GEMM-bound and take torch's GEMMs).
 */
#include <stdlib.h>

#include "cpu_common.h"

INLINE float dotf(const float *a, const float *b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* One expert's n assignments (rows[j]: its token's float32 row; slot[j]: its assignment index). */
INLINE void expert_task(enum dtype t, int es, const char *w13, const char *w2, const float *const *rows,
                        const int *slot, int n, float *y, int D, int I, int has_limit, float limit, float *h,
                        float *wrow) {
    for (int r = 0; r < 2 * I; r++) { /* h[j] = [gate | up] = W13 x */
        load_row(t, wrow, w13 + (int64_t)r * D * es, D);
        for (int j = 0; j < n; j++) h[(int64_t)j * 2 * I + r] = round_to(t, dotf(wrow, rows[j], D));
    }
    for (int j = 0; j < n; j++) { /* act = silu(min(gate, limit)) * clamp(up, -limit, limit) */
        float *g = h + (int64_t)j * 2 * I, *u = g + I;
#pragma omp simd
        for (int i = 0; i < I; i++) {
            const float gi = has_limit ? fminf(g[i], limit) : g[i];
            const float ui = has_limit ? fminf(fmaxf(u[i], -limit), limit) : u[i];
            g[i] = round_to(t, gi / (1.f + fast_exp(-gi)) * ui);
        }
    }
    for (int d = 0; d < D; d++) { /* y = W2 act */
        load_row(t, wrow, w2 + (int64_t)d * I * es, I);
        for (int j = 0; j < n; j++) y[(int64_t)slot[j] * D + d] = round_to(t, dotf(wrow, h + (int64_t)j * 2 * I, I));
    }
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
        const int mx = D > I ? D : I;
        float *wrow = malloc((size_t)mx * sizeof(float)), *h = NULL;
        const float **rows = malloc(((size_t)A + 1) * sizeof(float *));
        int *slot = malloc(((size_t)A + 1) * sizeof(int));
        int h_rows = 0;
#pragma omp for schedule(dynamic, 1)
        for (int e = 0; e < E; e++) {
            const int s = start[e], n = start[e + 1] - s;
            if (n == 0 || !wrow || !rows || !slot) continue;
            if (n > h_rows) {
                free(h);
                h = malloc((size_t)n * 2 * I * sizeof(float));
                h_rows = h ? n : 0;
                if (!h) continue;
            }
            for (int j = 0; j < n; j++) {
                slot[j] = order[s + j];
                rows[j] = xf + (int64_t)(slot[j] / k) * D;
            }
            expert_task(t, es, w13 + (int64_t)e * 2 * I * D * es, w2 + (int64_t)e * D * I * es, rows, slot, n, y, D,
                        I, has_limit, limit, h, wrow);
        }
        free(wrow), free(h), free(rows), free(slot);
    }
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
