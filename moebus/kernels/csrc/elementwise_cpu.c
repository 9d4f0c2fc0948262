/* Row-wise CPU kernels: fused residual-add + RMSNorm, SwiGLU (silu(gate) * up), neox rotary.
 * Semantics are those of the torch references in kernels/rmsnorm.py, silu_mul.py, rotary.py:
 * float32 math, one rounding to the storage type at the end (and of the residual sum, which the
 * norm then reads back rounded, as an unfused model would). Rows run in parallel (OpenMP), a
 * single row on the calling thread: a batch-1 decode step would otherwise wake the pool for one
 * row of work several times a layer. Every row's last dim is contiguous, row strides are in
 * elements. */
#include "cpu_common.h"

#define MAXN 16384
#define MAXD_ROT 1024

/* out = rmsnorm(x [+ residual]) * w; with a residual, res_out = x + residual (rounded). */
INLINE void rms_norm_impl(enum dtype t, const void *x, int64_t xs, const void *res, int64_t rs,
                          const void *w, void *out, void *res_out, int64_t rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float v[MAXN];
        const int es = t == F32 ? 4 : 2;
        const char *xr = (const char *)x + r * xs * es;
        load_row(t, v, xr, n);
        if (res) {
            const char *rr = (const char *)res + r * rs * es;
            char *ro = (char *)res_out + r * (int64_t)n * es;
#pragma omp simd
            for (int i = 0; i < n; i++) v[i] = round_to(t, v[i] + load1(t, rr, i));
            store_row(t, ro, v, 1.f, n);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += v[i] * v[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
        char *orow = (char *)out + r * (int64_t)n * es;
#pragma omp simd
        for (int i = 0; i < n; i++) store1(t, orow, i, v[i] * inv * load1(t, w, i));
    }
}

/* out [rows, I] = silu(min(gate, limit)) * clamp(up, -limit, limit); x [rows, 2I]. Rows are
 * converted to float32 buffers first so that every loop is a plain vectorizable float loop. */
INLINE void silu_mul_impl(enum dtype t, const void *x, int64_t xs, void *out, int64_t rows, int inter,
                          int has_limit, float limit) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float g[MAXN], u[MAXN];
        const int es = t == F32 ? 4 : 2;
        const char *xr = (const char *)x + r * xs * es;
        for (int i0 = 0; i0 < inter; i0 += MAXN) {
            const int n = inter - i0 < MAXN ? inter - i0 : MAXN;
            load_row(t, g, xr + (int64_t)i0 * es, n);
            load_row(t, u, xr + ((int64_t)inter + i0) * es, n);
            if (has_limit) {
#pragma omp simd
                for (int i = 0; i < n; i++) {
                    g[i] = fminf(g[i], limit);
                    u[i] = fminf(fmaxf(u[i], -limit), limit);
                }
            }
#pragma omp simd
            for (int i = 0; i < n; i++) g[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
            store_row(t, (char *)out + (r * (int64_t)inter + i0) * es, g, 1.f, n);
        }
    }
}

/* out [T, H, D] (contiguous) = x rotated on its first 2*half channels; cos/sin [T, half] fp32. */
INLINE void rotary_impl(enum dtype t, const void *x, int64_t xs_t, int64_t xs_h, const float *cos_,
                        const float *sin_, int64_t cs, void *out, int64_t T, int H, int D, int half) {
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t tok = 0; tok < T; tok++) {
        float v[MAXD_ROT], o[MAXD_ROT];
        const int es = t == F32 ? 4 : 2;
        const float *c = cos_ + tok * cs, *s = sin_ + tok * cs;
        for (int h = 0; h < H; h++) {
            load_row(t, v, (const char *)x + (tok * xs_t + h * xs_h) * es, D);
#pragma omp simd
            for (int i = 0; i < half; i++) {
                o[i] = v[i] * c[i] - v[i + half] * s[i];
                o[i + half] = v[i + half] * c[i] + v[i] * s[i];
            }
            for (int i = 2 * half; i < D; i++) o[i] = v[i];  /* partial rotary: the rest passes */
            store_row(t, (char *)out + (tok * H + h) * (int64_t)D * es, o, 1.f, D);
        }
    }
}

/* Entry points per storage type; each returns 1 when a shape is beyond the kernel's limits. */
#define DEFINE_ELEMENTWISE(SUFFIX, DT)                                                                  \
    int rms_norm_##SUFFIX(const void *x, int64_t xs, const void *res, int64_t rs, const void *w, void *out, \
                          void *res_out, int64_t rows, int n, float eps) {                                \
        if (n > MAXN) return 1;                                                                           \
        rms_norm_impl(DT, x, xs, res, rs, w, out, res_out, rows, n, eps);                                 \
        return 0;                                                                                         \
    }                                                                                                     \
    int silu_mul_##SUFFIX(const void *x, int64_t xs, void *out, int64_t rows, int inter, int has_limit,   \
                          float limit) {                                                                  \
        silu_mul_impl(DT, x, xs, out, rows, inter, has_limit, limit);                                     \
        return 0;                                                                                         \
    }                                                                                                     \
    int rotary_##SUFFIX(const void *x, int64_t xs_t, int64_t xs_h, const float *cos_, const float *sin_,  \
                        int64_t cs, void *out, int64_t T, int H, int D, int half) {                       \
        if (D > MAXD_ROT) return 1;                                                                       \
        rotary_impl(DT, x, xs_t, xs_h, cos_, sin_, cs, out, T, H, D, half);                               \
        return 0;                                                                                         \
    }

DEFINE_ELEMENTWISE(f32, F32)
DEFINE_ELEMENTWISE(bf16, BF16)
DEFINE_ELEMENTWISE(f16, F16)
