/* Shared helpers of the CPU kernels: element types, row conversion to/from float32, a
 * vectorizable exp. Every kernel computes in float32 whatever the storage type. */
#ifndef MOEBUS_CPU_COMMON_H
#define MOEBUS_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum dtype { F32 = 0, BF16 = 1, F16 = 2 };

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* nearest even, as torch */
    return (uint16_t)(u >> 16);
}

INLINE float load1(enum dtype t, const void *p, int64_t i) {
    if (t == F32) return ((const float *)p)[i];
    if (t == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

INLINE void store1(enum dtype t, void *p, int64_t i, float x) {
    if (t == F32) ((float *)p)[i] = x;
    else if (t == BF16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((_Float16 *)p)[i] = (_Float16)x;
}

/* x rounded to the storage type and back, as a store followed by a load would give. */
INLINE float round_to(enum dtype t, float x) {
    if (t == F32) return x;
    if (t == BF16) return bf16_to_f32(f32_to_bf16(x));
    return (float)(_Float16)x;
}

INLINE void load_row(enum dtype t, float *dst, const void *src, int n) {
    if (t == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = load1(t, src, i);
}

INLINE void store_row(enum dtype t, void *dst, const float *src, float mul, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) store1(t, dst, i, src[i] * mul);
}

/* Runs STMT with `t` (and `es`, its element size) compile-time constants. OpenMP outlines a parallel
 * region before inlining, so one region serves every dtype instance of an inline kernel and a
 * dtype passed in is a runtime value there: every row load branches on it and loops stay scalar.
 * Switching inside the region gives each dtype its own copy of the loop body. */
#define DTYPE_CASE(T, ES, STMT)     \
    {                               \
        const enum dtype t_ = T;    \
        const int es_ = ES;         \
        (void)t_, (void)es_;        \
        STMT;                       \
    }
#define WITH_DTYPE(t, STMT)                     \
    switch (t) {                                \
    case F32: DTYPE_CASE(F32, 4, STMT) break;   \
    case BF16: DTYPE_CASE(BF16, 2, STMT) break; \
    default: DTYPE_CASE(F16, 2, STMT)           \
    }

/* min(x, hi) and max(min(x, hi), lo) as torch.clamp: NaN passes through. Selects, not libm's
 * fminf/fmaxf (calls GCC keeps for their NaN rule), so that `omp simd` loops vectorize. */
INLINE float min_hi(float x, float hi) { return x > hi ? hi : x; }
INLINE float clamp_lo_hi(float x, float lo, float hi) { return x > hi ? hi : (x < lo ? lo : x); }

/* exp(x) within ~2 ulp for x in [-87, 88.7], 0 below (exp(-inf) = 0), inf above; branch-free so
 * that `omp simd` loops vectorize it (libm's expf is a scalar call). */
INLINE float fast_exp(float x) {
    const float xc = x > 88.f ? 88.f : (x < -87.f ? -87.f : x);
    const float n = __builtin_rintf(xc * 1.44269504088896341f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f; /* Cody-Waite ln2 split */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23; /* times 2^n */
    float out;
    memcpy(&out, &bits, sizeof out);
    out = x > 88.72f ? INFINITY : out;
    return x < -87.f ? 0.f : out;
}

/* Max of x[0..len) and whether a NaN occurs; a vectorised reduction. */
INLINE float block_max(const float *x, int len, int *nan) {
    float m = -INFINITY;
    int any = 0;
#pragma omp simd reduction(max : m) reduction(| : any)
    for (int i = 0; i < len; i++) {
        any |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *nan = any;
    return m;
}

#endif
