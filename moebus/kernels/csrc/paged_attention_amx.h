/* The AMX part of paged_attention_cpu.c (included there after its AVX-512 helpers; needs TILE):
 * bf16 QK of 16 positions x every query head per tile product. HAVE_AMX says whether it is built. */
#ifndef MOEBUS_PAGED_ATTENTION_AMX_H
#define MOEBUS_PAGED_ATTENTION_AMX_H

#if HAVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_common.h"
#define HAVE_AMX 1
#define AMX_QT 6 /* tiles for q: one per (kv head, 32 dims) */

/* bf16 QK on AMX: 16 positions of a page at a time, every query head at once. tmm0 = C [16
 * positions][Hq] float32; tmm1 = A, the 16 positions' keys of one kv head, 32 dims (rows read in
 * place, the slot stride apart); tmm2.. = B, per (kv head, 32 dims) the q pairs of every query head,
 * zero for the heads of other kv heads, so the Hkv * D / 32 products sum to each head's own score. */
static int amx_applies(enum dtype t, int Hq, int Hkv, int D, int bs) {
    return t == BF16 && Hq <= 16 && D % 32 == 0 && Hkv * (D / 32) <= AMX_QT && bs % 16 == 0 && amx_permitted();
}

static void amx_configure(int Hq, int nq) { /* thread state: once per thread and call */
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2 + nq; i++) c.rows[i] = 16, c.colsb[i] = i == 1 ? 64 : Hq * 4;
    _tile_loadconfig(&c);
}

/* B tiles for the q [Hq, D] bf16 of one sequence: qt[i][pair][h], i = kh * D / 32 + dims / 32. */
static inline void amx_load_q(uint32_t (*qt)[256], const char *q, int64_t q_sh, int Hq, int G, int D) {
    const int nh = D / 32, nq = Hq / G * nh;
    for (int i = 0; i < nq; i++) {
        memset(qt[i], 0, (size_t)16 * Hq * 4);
        const int kh = i / nh, d0 = (i % nh) * 32;
        for (int h = kh * G; h < (kh + 1) * G; h++)
            for (int p = 0; p < 16; p++) memcpy(&qt[i][p * Hq + h], q + (h * q_sh + d0 + 2 * p) * 2, 4);
    }
    _tile_loadd(2, qt[0], Hq * 4);
    if (nq > 1) _tile_loadd(3, qt[1], Hq * 4);
    if (nq > 2) _tile_loadd(4, qt[2], Hq * 4);
    if (nq > 3) _tile_loadd(5, qt[3], Hq * 4);
    if (nq > 4) _tile_loadd(6, qt[4], Hq * 4);
    if (nq > 5) _tile_loadd(7, qt[5], Hq * 4);
}

/* 16 x 16 floats transposed in registers (unpacks, then 128-bit lane shuffles). */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 16; i += 8)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88),
            t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88), r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
}

/* s[h][j] for every query head and the n <= TILE positions of a tile that starts on a 16-position
 * boundary (so each 16 lie in one page; slots past n are in the page and unused). */
static inline __attribute__((always_inline)) void qk_amx(float (*s)[TILE], const char *const *ks, int64_t k_ss,
                                                         int64_t k_sh, int n, int Hq, int Hkv, int D, float scale) {
    const int nh = D / 32;
    float c[16][16] __attribute__((aligned(64))) = {{0}}; /* columns past Hq stay 0 */
    for (int jb = 0; jb < n; jb += 16) {
        const int m = n - jb < 16 ? n - jb : 16;
        _tile_zero(0);
        for (int i = 0; i < Hkv * nh; i++) {
            _tile_loadd(1, ks[jb] + ((i / nh) * k_sh + (i % nh) * 32) * 2, k_ss * 2);
            switch (i) { /* tile numbers are immediates */
            case 0: _tile_dpbf16ps(0, 1, 2); break;
            case 1: _tile_dpbf16ps(0, 1, 3); break;
            case 2: _tile_dpbf16ps(0, 1, 4); break;
            case 3: _tile_dpbf16ps(0, 1, 5); break;
            case 4: _tile_dpbf16ps(0, 1, 6); break;
            default: _tile_dpbf16ps(0, 1, 7); break;
            }
        }
        _tile_stored(0, c, 64);
        __m512 r[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(c[j]);
        transpose16(r);
        for (int h = 0; h < Hq; h++)
            _mm512_mask_storeu_ps(&s[h][jb], (__mmask16)((1u << m) - 1), _mm512_mul_ps(r[h], _mm512_set1_ps(scale)));
    }
}
#else
#define HAVE_AMX 0
#endif
#endif
