/* The AVX-512 row code of elementwise_cpu.c: 16 float32 lanes, masked tails, bf16/f16 widened on
 * load and rounded once on store. Same math as the plain loops there (and the torch references);
 * only summation order differs. Needs AVX512F/BW/VL (masked 16-bit loads and stores). */
#ifndef MOEBUS_ELEMENTWISE_AVX512_H
#define MOEBUS_ELEMENTWISE_AVX512_H
#include <immintrin.h>

#include "cpu_common.h"

INLINE __mmask16 tail16(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

INLINE __m512 vload16(enum dtype t, const void *p, int64_t i, __mmask16 m) {
    if (t == F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (t == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* float32 -> bf16, nearest even; NaN stays a (quiet) NaN. vcvtneps2bf16 where the CPU has it
 * (it also flushes float32 denormal inputs, |x| < 1.2e-38, to zero; torch rounds them). */
INLINE __m256i bf16_round16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

INLINE __m256i narrow16(enum dtype t, __m512 v) {
    return t == BF16 ? bf16_round16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

INLINE void vstore16(enum dtype t, void *p, int64_t i, __m512 v, __mmask16 m) {
    if (t == F32) _mm512_mask_storeu_ps((float *)p + i, m, v);
    else _mm256_mask_storeu_epi16((uint16_t *)p + i, m, narrow16(t, v));
}

/* v rounded to the storage type and back (a store then a load). */
INLINE __m512 vround16(enum dtype t, __m512 v) {
    if (t == F32) return v;
    const __m256i h = narrow16(t, v);
    if (t == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* sigmoid(g) = 1 / (1 + exp(-g)), for SiLU. exp as cpu_common.h's fast_exp (Cody-Waite split, the
 * same polynomial), 2^n by vscalefps, which saturates to 0 itself; 1 / d by rcp14 and one Newton
 * step (~2^-28 relative; a division cost as much as the rest of the loop). d must stay finite for
 * that, so below g = -88 the sigmoid is 0: silu gives -0 there (torch: -0 below -88.7, ~1e-37
 * between) and NaN at -inf, as torch. max/min take g second so that a NaN passes through. */
INLINE __m512 vsigmoid16(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 gc = _mm512_min_ps(_mm512_set1_ps(150.f), _mm512_max_ps(_mm512_set1_ps(-88.f), g));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(gc, _mm512_set1_ps(-1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); /* x = -gc */
    __m512 r = _mm512_fnmsub_ps(n, _mm512_set1_ps(0.693359375f), gc);               /* x - n*ln2_hi */
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, one));
    const __m512 d = _mm512_add_ps(one, _mm512_scalef_ps(p, n));
    const __m512 y = _mm512_rcp14_ps(d);
    const __mmask16 live = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.f), _CMP_GE_OQ);
    return _mm512_maskz_fmadd_ps(live, y, _mm512_fnmadd_ps(d, y, one), y);
}

INLINE float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

INLINE void norm_row16(enum dtype t, int es, const char *xr, const char *rr, const void *w, char *orow, char *ro,
                       int n, float eps) {
    float v[MAXN]; /* the (rounded) sum, read again by the second pass */
    __m512 ss = _mm512_setzero_ps();
    (void)es;
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail16(n - i);
        __m512 a = vload16(t, xr, i, m);
        if (rr) {
            a = vround16(t, _mm512_add_ps(a, vload16(t, rr, i, m)));
            vstore16(t, ro, i, a, m);
        }
        _mm512_mask_storeu_ps(v + i, m, a);
        ss = _mm512_fmadd_ps(a, a, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(hsum16(ss) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail16(n - i);
        const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), inv);
        vstore16(t, orow, i, _mm512_mul_ps(a, vload16(t, w, i, m)), m);
    }
}

INLINE void silu_block16(enum dtype t, const char *g_in, const char *u_in, char *o, int n, int has_limit,
                         float limit) {
    const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail16(n - i);
        __m512 g = vload16(t, g_in, i, m), u = vload16(t, u_in, i, m);
        if (has_limit) { /* as torch.clamp: a NaN passes (second operand of min/max) */
            g = _mm512_min_ps(hi, g);
            u = _mm512_min_ps(hi, _mm512_max_ps(lo, u));
        }
        vstore16(t, o, i, _mm512_mul_ps(_mm512_mul_ps(g, vsigmoid16(g)), u), m);
    }
}

INLINE void rotary_head16(enum dtype t, const char *x, const float *c, const float *s, char *o, int D, int half) {
    const int es = t == F32 ? 4 : 2;
    for (int i = 0; i < half; i += 16) { /* chunk i reads [i, i+16) and [half+i, ...) before writing them */
        const __mmask16 m = tail16(half - i);
        const __m512 x1 = vload16(t, x, i, m), x2 = vload16(t, x, i + half, m);
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
        vstore16(t, o, i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), m);
        vstore16(t, o, i + half, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), m);
    }
    if (o != x && D > 2 * half) /* partial rotary: the rest passes */
        memcpy(o + (int64_t)2 * half * es, x + (int64_t)2 * half * es, (size_t)(D - 2 * half) * es);
}

#endif
