/* DeepSeek-V4 compressor window pooling (kernels/compressor.py): per window n and channel c,
 * out = sum_l softmax_l(gate[n,l,c] + bias[l,c]) * kv[n,l,c]. float32 math (libm expf: exp(-inf)
 * is 0, so masked slots drop out), one rounding to the storage type. Windows run in parallel. */
#include "cpu_common.h"

#define MAXC 4096

INLINE void compress_impl(enum dtype t, const void *kv, const void *gate, const float *bias, void *out,
                          int64_t n, int L, int C) {
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < n; w++) {
        float m[MAXC], s[MAXC], acc[MAXC], g[MAXC], x[MAXC];
        const int es = t == F32 ? 4 : 2;
        for (int c = 0; c < C; c++) m[c] = -INFINITY, s[c] = 0.f, acc[c] = 0.f;
        for (int l = 0; l < L; l++) { /* first pass: column maxima */
            load_row(t, g, (const char *)gate + ((w * L + l) * (int64_t)C) * es, C);
            for (int c = 0; c < C; c++) {
                const float v = g[c] + bias[(int64_t)l * C + c];
                m[c] = v > m[c] ? v : m[c];
            }
        }
        for (int l = 0; l < L; l++) {
            load_row(t, g, (const char *)gate + ((w * L + l) * (int64_t)C) * es, C);
            load_row(t, x, (const char *)kv + ((w * L + l) * (int64_t)C) * es, C);
            for (int c = 0; c < C; c++) {
                const float e = expf(g[c] + bias[(int64_t)l * C + c] - m[c]);
                s[c] += e;
                acc[c] += e * x[c];
            }
        }
        for (int c = 0; c < C; c++) acc[c] /= s[c];
        store_row(t, (char *)out + w * (int64_t)C * es, acc, 1.f, C);
    }
}

#define DEFINE(SUFFIX, T)                                                                              \
    int compress_windows_##SUFFIX(const void *kv, const void *gate, const float *bias, void *out,      \
                                  int64_t n, int L, int C) {                                           \
        if (C > MAXC || L < 1) return 1;                                                               \
        compress_impl(T, kv, gate, bias, out, n, L, C);                                                \
        return 0;                                                                                      \
    }
DEFINE(f32, F32)
DEFINE(bf16, BF16)
DEFINE(f16, F16)
