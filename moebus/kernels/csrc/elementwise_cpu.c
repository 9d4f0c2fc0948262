/* Row-wise CPU kernels: fused residual-add + RMSNorm, SwiGLU (silu(gate) * up), neox rotary.
 * Semantics are those of the torch references in kernels/rmsnorm.py, silu_mul.py, rotary.py:
 * float32 math, one rounding to the storage type at the end (and of the residual sum, which the
 * norm then reads back rounded, as an unfused model would). Every row's last dim is contiguous,
 * row strides are in elements.
 *
 * Rows run in parallel (OpenMP, static split), a single row on the calling thread: a batch-1
 * decode step would otherwise wake the pool for one row of work several times a layer (16 rows in
 * parallel measured no slower than on one thread). Inside a parallel region the dtype is a
 * compile-time constant (WITH_DTYPE, cpu_common.h).
 *
 * With AVX-512 the rows are explicit 16-lane code with masked tails (elementwise_avx512.h); bf16
 * stores use vcvtneps2bf16 where the CPU has AVX512_BF16, SiLU an rcp14 sigmoid. 2048 rows, bf16,
 * 1 thread, against the plain loops (auto-vectorized, 256-bit): SiLU-and-mul 2.8 -> 1.7 ms,
 * add + norm 1.1 -> 0.5 ms, rotary 0.8 -> 0.4 ms. Without AVX-512 the plain loops are left to the
 * auto-vectorizer (AVX2) or stay scalar. */
#include "cpu_common.h"

#define MAXN 16384
#define MAXD_ROT 1024
#define SILU_BLOCK 512 /* columns per block: gate and up float32 buffers stay in L1 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ELEM_AVX512 1
#include "elementwise_avx512.h"
#endif

/* out = rmsnorm(x [+ residual]) * w; with a residual, res_out = x + residual (rounded). */
INLINE void norm_row(enum dtype t, int es, const char *xr, const char *rr, const void *w, char *orow, char *ro,
                     int n, float eps) {
#ifdef ELEM_AVX512
    norm_row16(t, es, xr, rr, w, orow, ro, n, eps);
#else
    float v[MAXN];
    (void)es;
    load_row(t, v, xr, n);
    if (rr) {
#pragma omp simd
        for (int i = 0; i < n; i++) v[i] = round_to(t, v[i] + load1(t, rr, i));
        store_row(t, ro, v, 1.f, n);
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) ss += v[i] * v[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) store1(t, orow, i, v[i] * inv * load1(t, w, i));
#endif
}

INLINE void rms_norm_impl(enum dtype t, const void *x, int64_t xs, const void *res, int64_t rs,
                          const void *w, void *out, void *res_out, int64_t rows, int n, float eps) {
    const int es = t == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * xs * es;
        const char *rr = res ? (const char *)res + r * rs * es : NULL;
        char *ro = res ? (char *)res_out + r * (int64_t)n * es : NULL;
        WITH_DTYPE(t, norm_row(t_, es_, xr, rr, w, (char *)out + r * (int64_t)n * es, ro, n, eps));
    }
}

/* out[0..n) = silu(min(g, limit)) * clamp(u, -limit, limit) for one block of columns. */
INLINE void silu_block(enum dtype t, const char *g_in, const char *u_in, char *o, int n, int has_limit,
                       float limit) {
#ifdef ELEM_AVX512
    silu_block16(t, g_in, u_in, o, n, has_limit, limit);
#else
    float g[SILU_BLOCK], u[SILU_BLOCK];
    load_row(t, g, g_in, n);
    load_row(t, u, u_in, n);
    if (has_limit) {
#pragma omp simd
        for (int i = 0; i < n; i++) {
            g[i] = min_hi(g[i], limit);
            u[i] = clamp_lo_hi(u[i], -limit, limit);
        }
    }
#pragma omp simd
    for (int i = 0; i < n; i++) g[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
    store_row(t, o, g, 1.f, n);
#endif
}

/* out [rows, I] = silu(min(gate, limit)) * clamp(up, -limit, limit); x [rows, 2I]. */
INLINE void silu_mul_impl(enum dtype t, const void *x, int64_t xs, void *out, int64_t rows, int inter,
                          int has_limit, float limit) {
    const int es = t == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * xs * es;
        char *orow = (char *)out + r * (int64_t)inter * es;
        for (int i0 = 0; i0 < inter; i0 += SILU_BLOCK) {
            const int n = inter - i0 < SILU_BLOCK ? inter - i0 : SILU_BLOCK;
            WITH_DTYPE(t, silu_block(t_, xr + (int64_t)i0 * es_, xr + ((int64_t)inter + i0) * es_,
                                     orow + (int64_t)i0 * es_, n, has_limit, limit));
        }
    }
}

/* One token's H heads rotated on their first 2*half channels; the rest pass. x and o may alias
 * (in place): each head is read whole before it is written. */
INLINE void rotary_token(enum dtype t, int es, const char *x, int64_t xs_h, const float *c, const float *s,
                         char *o, int64_t os_h, int H, int D, int half) {
    for (int h = 0; h < H; h++) {
        const char *xh = x + h * xs_h * es;
        char *oh = o + h * os_h * es;
#ifdef ELEM_AVX512
        rotary_head16(t, xh, c, s, oh, D, half);
#else
        float v[MAXD_ROT], r[MAXD_ROT];
        load_row(t, v, xh, D);
#pragma omp simd
        for (int i = 0; i < half; i++) {
            r[i] = v[i] * c[i] - v[i + half] * s[i];
            r[i + half] = v[i + half] * c[i] + v[i] * s[i];
        }
        for (int i = 2 * half; i < D; i++) r[i] = v[i]; /* partial rotary: the rest passes */
        store_row(t, oh, r, 1.f, D);
#endif
    }
    (void)es;
}

/* out = x rotated; x and out [T, H, D] with strides in elements (out may be x itself); cos/sin
 * [T, half] fp32 with row stride cs. */
INLINE void rotary_impl(enum dtype t, const void *x, int64_t xs_t, int64_t xs_h, const float *cos_,
                        const float *sin_, int64_t cs, void *out, int64_t os_t, int64_t os_h, int64_t T, int H,
                        int D, int half) {
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t tok = 0; tok < T; tok++) {
        WITH_DTYPE(t, rotary_token(t_, es_, (const char *)x + tok * xs_t * es_, xs_h, cos_ + tok * cs,
                                   sin_ + tok * cs, (char *)out + tok * os_t * es_, os_h, H, D, half));
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
                        int64_t cs, void *out, int64_t os_t, int64_t os_h, int64_t T, int H, int D, int half) { \
        if (D > MAXD_ROT) return 1;                                                                       \
        rotary_impl(DT, x, xs_t, xs_h, cos_, sin_, cs, out, os_t, os_h, T, H, D, half);                   \
        return 0;                                                                                         \
    }

DEFINE_ELEMENTWISE(f32, F32)
DEFINE_ELEMENTWISE(bf16, BF16)
DEFINE_ELEMENTWISE(f16, F16)

/* Which row code this build has: 0 plain loops, 1 AVX-512, 2 AVX-512 with vcvtneps2bf16. */
int elementwise_isa(void) {
#if defined(ELEM_AVX512) && defined(__AVX512BF16__)
    return 2;
#elif defined(ELEM_AVX512)
    return 1;
#else
    return 0;
#endif
}
