/* mHC mixing weights per token (DeepSeek-V4 hyper-connections): sigmoid gates pre/post and a
 * Sinkhorn-normalised n x n stream mixture. kernels/mhc.py's torch reference is the spec: mix
 * [T, (2 + n) n] float32 with row stride ms, base [(2 + n) n], scale [3]; outputs pre [T, n],
 * post [T, n], comb [T, n, n], contiguous. Everything is float32 with libm's expf: the work is a
 * few hundred flops a token, so the point is one call instead of ~4 * iters torch ops.
 */
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_dot.h"

#define MAXN 16

static inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* One token: mixture logits m [(2 + n) n] -> pre [n], post [n], comb [n, n]. */
INLINE void hc_mix_token(const float *m, const float *base, const float *scale, float *pr, float *po, float *co,
                         int n, int iters, float eps) {
    const float *mc = m + 2 * n, *bc = base + 2 * n;
    float c[MAXN][MAXN], colsum[MAXN];
    for (int i = 0; i < n; i++) {
        pr[i] = sigmoid(m[i] * scale[0] + base[i]) + eps;
        po[i] = 2.f * sigmoid(m[n + i] * scale[1] + base[n + i]);
    }
    for (int r = 0; r < n; r++) { /* row softmax */
        float mx = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) {
            c[r][j] = mc[r * n + j] * scale[2] + bc[r * n + j];
            mx = c[r][j] > mx ? c[r][j] : mx;
        }
        for (int j = 0; j < n; j++) sum += (c[r][j] = expf(c[r][j] - mx));
        for (int j = 0; j < n; j++) c[r][j] = c[r][j] / sum + eps;
    }
    for (int round = 0; round < iters; round++) {
        if (round > 0)
            for (int r = 0; r < n; r++) { /* rows (every round but the first) */
                float sum = 0.f;
                for (int j = 0; j < n; j++) sum += c[r][j];
                const float inv = 1.f / (sum + eps); /* one divide per row: divides dominated the kernel */
                for (int j = 0; j < n; j++) c[r][j] *= inv;
            }
        for (int j = 0; j < n; j++) colsum[j] = 0.f; /* then columns */
        for (int r = 0; r < n; r++)
            for (int j = 0; j < n; j++) colsum[j] += c[r][j];
        for (int j = 0; j < n; j++) colsum[j] = 1.f / (colsum[j] + eps);
        for (int r = 0; r < n; r++)
            for (int j = 0; j < n; j++) c[r][j] *= colsum[j];
    }
    for (int r = 0; r < n; r++)
        for (int j = 0; j < n; j++) co[r * n + j] = c[r][j];
}

/* Returns 0 on success, 1 when n is outside the kernel's limits (caller falls back). */
int hc_mix_f32(const float *mix, int64_t ms, const float *base, const float *scale, float *pre, float *post,
               float *comb, int64_t T, int n, int iters, float eps) {
    if (n < 1 || n > MAXN || iters < 1) return 1;
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++)
        hc_mix_token(mix + t * ms, base, scale, pre + t * n, post + t * n, comb + t * n * n, n, iters, eps);
    return 0;
}

/* A whole mHC "pre" for tokens t0 and t1 (equal for a lone last token): RMS of the flattened
 * streams, the mixture logits fn . x / rms (2 tokens x 4 fn rows per tile), the gates and Sinkhorn
 * of hc_mix_token, and the collapse sum_j pre_j * streams_j rounded to the storage type. x: 2 n H
 * floats of scratch. */
INLINE void hc_pre_pair(enum dtype t, int es, const char *s, const float *fn, const float *base, const float *scale,
                        char *collapsed, float *post, float *comb, int64_t t0, int64_t t1, int n, int64_t H,
                        int iters, float hc_eps, float norm_eps, float *x) {
    const int64_t nh = n * H;
    const int W = (2 + n) * n;
    float mix[2][(2 + MAXN) * MAXN], pre[MAXN], acc[256];
    const float *rows[2] = {x, x + nh};
    float *dst[2] = {mix[0], mix[1]};
    for (int i = 0; i < 2; i++) load_row(t, x + i * nh, s + (i ? t1 : t0) * nh * es, (int)nh);
    dots_rows(F32, 4, (const char *)fn, nh * 4, W, rows, t1 == t0 ? 1 : 2, (int)nh, dst);
    for (int i = 0; i < (t1 == t0 ? 1 : 2); i++) {
        const int64_t tok = i ? t1 : t0;
        const float *xr = rows[i];
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t k = 0; k < nh; k++) ss += xr[k] * xr[k];
        const float inv = 1.f / sqrtf(ss / (float)nh + norm_eps);
        for (int w = 0; w < W; w++) mix[i][w] *= inv;
        hc_mix_token(mix[i], base, scale, pre, post + tok * n, comb + tok * n * n, n, iters, hc_eps);
        for (int64_t h0 = 0; h0 < H; h0 += 256) {
            const int m = H - h0 < 256 ? (int)(H - h0) : 256;
            for (int k = 0; k < m; k++) acc[k] = 0.f;
            for (int j = 0; j < n; j++) {
                const float pj = pre[j], *sj = xr + j * H + h0;
#pragma omp simd
                for (int k = 0; k < m; k++) acc[k] += pj * sj[k];
            }
            store_row(t, collapsed + (tok * H + h0) * es, acc, 1.f, m);
        }
    }
}

INLINE int hc_pre_impl(enum dtype t, const char *s, const float *fn, const float *base, const float *scale,
                       char *collapsed, float *post, float *comb, int64_t T, int n, int64_t H, int iters,
                       float hc_eps, float norm_eps) {
    if (n < 1 || n > MAXN || iters < 1 || n * H > (1 << 26)) return 1;
    int status = 0;
#pragma omp parallel if (T * n * H >= 8192)
    {
        float *x = malloc((size_t)2 * n * H * sizeof(float));
        if (!x) {
#pragma omp atomic write
            status = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (T + 1) / 2; p++) {
            if (!x) continue;
            const int64_t t0 = 2 * p, t1 = 2 * p + 1 < T ? 2 * p + 1 : 2 * p;
            WITH_DTYPE(t, hc_pre_pair(t_, es_, s, fn, base, scale, collapsed, post, comb, t0, t1, n, H, iters, hc_eps,
                                      norm_eps, x));
        }
        free(x);
    }
    return status;
}

/* New streams out[t, k, :] = post[t, k] * b[t, :] + sum_j comb[t, j, k] * s[t, j, :] in float32,
 * rounded once: s, out [T, n, H] and b [T, H] contiguous in the storage type, post [T, n] and comb
 * [T, n, n] float32 contiguous. */
INLINE int hc_merge_impl(enum dtype t, int es, const char *s, const char *b, const float *post, const float *comb,
                         char *out, int64_t T, int n, int64_t H) {
    if (n < 1 || n > MAXN) return 1;
#pragma omp parallel for schedule(static) if (T * n * H >= 65536)
    for (int64_t tok = 0; tok < T; tok++) {
        float acc[256], row[256];
        const float *c = comb + tok * n * n;
        for (int64_t h0 = 0; h0 < H; h0 += 256) {
            const int m = H - h0 < 256 ? (int)(H - h0) : 256;
            for (int k = 0; k < n; k++) {
                load_row(t, acc, b + (tok * H + h0) * es, m);
                const float p = post[tok * n + k];
#pragma omp simd
                for (int i = 0; i < m; i++) acc[i] *= p;
                for (int j = 0; j < n; j++) {
                    load_row(t, row, s + ((tok * n + j) * H + h0) * es, m);
                    const float w = c[j * n + k];
#pragma omp simd
                    for (int i = 0; i < m; i++) acc[i] += w * row[i];
                }
                store_row(t, out + ((tok * n + k) * H + h0) * es, acc, 1.f, m);
            }
        }
    }
    return 0;
}

#define DEFINE_HC_MERGE(SUFFIX, DT, ES)                                                                        \
    int hc_merge_##SUFFIX(const void *s, const void *b, const float *post, const float *comb, void *out,       \
                          int64_t T, int n, int64_t H) {                                                       \
        return hc_merge_impl(DT, ES, (const char *)s, (const char *)b, post, comb, (char *)out, T, n, H);      \
    }

DEFINE_HC_MERGE(f32, F32, 4)
DEFINE_HC_MERGE(bf16, BF16, 2)
DEFINE_HC_MERGE(f16, F16, 2)

/* Returns 0 on success, 1 when n or n H is outside the kernel's limits or out of memory. */
#define DEFINE_HC_PRE(SUFFIX, DT)                                                                                 \
    int hc_pre_##SUFFIX(const void *s, const float *fn, const float *base, const float *scale, void *collapsed, \
                        float *post, float *comb, int64_t T, int n, int64_t H, int iters, float hc_eps,         \
                        float norm_eps) {                                                                       \
        return hc_pre_impl(DT, (const char *)s, fn, base, scale, (char *)collapsed, post, comb, T, n, H, iters, \
                           hc_eps, norm_eps);                                                                   \
    }

DEFINE_HC_PRE(f32, F32)
DEFINE_HC_PRE(bf16, BF16)
DEFINE_HC_PRE(f16, F16)
