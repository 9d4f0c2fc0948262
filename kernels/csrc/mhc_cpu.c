/* mHC mixing weights per token (DeepSeek-V4 hyper-connections): sigmoid gates pre/post and a
 * Sinkhorn-normalised n x n stream mixture. kernels/mhc.py's torch reference is the spec: mix
 * [T, (2 + n) n] float32 with row stride ms, base [(2 + n) n], scale [3]; outputs pre [T, n],
 * post [T, n], comb [T, n, n], contiguous. Everything is float32 with libm's expf: the work is a
 * few hundred flops a token, so the point is one call instead of ~4 * iters torch ops.
 */
#include "cpu_common.h"

#define MAXN 16

static inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* Returns 0 on success, 1 when n is outside the kernel's limits (caller falls back). */
int hc_mix_f32(const float *mix, int64_t ms, const float *base, const float *scale, float *pre, float *post,
               float *comb, int64_t T, int n, int iters, float eps) {
    if (n < 1 || n > MAXN || iters < 1) return 1;
#pragma omp parallel for schedule(static) if (T >= 512)
    for (int64_t t = 0; t < T; t++) {
        const float *m = mix + t * ms, *mc = m + 2 * n, *bc = base + 2 * n;
        float *pr = pre + t * n, *po = post + t * n;
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
                    for (int j = 0; j < n; j++) c[r][j] /= sum + eps;
                }
            for (int j = 0; j < n; j++) colsum[j] = 0.f; /* then columns */
            for (int r = 0; r < n; r++)
                for (int j = 0; j < n; j++) colsum[j] += c[r][j];
            for (int r = 0; r < n; r++)
                for (int j = 0; j < n; j++) c[r][j] /= colsum[j] + eps;
        }
        float *co = comb + t * n * n;
        for (int r = 0; r < n; r++)
            for (int j = 0; j < n; j++) co[r * n + j] = c[r][j];
    }
    return 0;
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
