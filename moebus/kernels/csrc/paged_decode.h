/* One sequence's paged decode attention (decode_one) and its tiles: the per-sequence body of
 * paged_attention_cpu.c (see there for the layouts and the why), in a header so that the batch-1
 * decode step (decode_stack_cpu.c) computes a bf16 model's attention with the very arithmetic the
 * module path's kernel uses. Heads are independent: a call over one kv head's G query heads (its
 * pointers offset to that head, Hkv 1, the strides unchanged) gives the bits of a call over all. */
#ifndef MOEBUS_PAGED_DECODE_H
#define MOEBUS_PAGED_DECODE_H
#include "cpu_common.h"
#include "cpu_dot.h"

#define MAXHQ 64
#define MAXD 256
#define TILE 32

/* The K and V cache slots of positions [t0, t0 + n): one walk over the table per tile, not a
 * division by the page size per row and head (strides sn (block), ss (slot) in elements). */
static inline __attribute__((always_inline)) void tile_slots(
    const char *kc, int64_t k_sn, int64_t k_ss, const char *vc, int64_t v_sn, int64_t v_ss, const int32_t *table,
    int t0, int n, int bs, int es, const char **ks, const char **vs) {
    int blk = t0 / bs, off = t0 % bs;
    for (int j = 0; j < n; j++) {
        const int64_t p = table[blk];
        ks[j] = kc + (p * k_sn + off * k_ss) * es;
        vs[j] = vc + (p * v_sn + off * v_ss) * es;
        if (++off == bs) off = 0, blk++;
    }
}

/* Pages are scattered, so the hardware stream prefetchers (which stop at 4 KiB boundaries) keep
 * restarting; ask for the n slot rows at r[] ahead of use instead. */
static inline void prefetch_rows(const char *const *r, int n, int64_t row_bytes) {
    for (int j = 0; j < n; j++)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(r[j] + off, 0, 2);
}

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
/* 16 elements at p as float32. */
static inline __attribute__((always_inline)) __m512 load16(enum dtype t, const char *p) {
    if (t == F32) return _mm512_loadu_ps((const float *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (t == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Partial q.k of one row as 16 lanes still to be summed. bf16 (with AVX512-BF16): unscaled bf16 q
 * against the bf16 row in vdpbf16ps, whose products are exact in float32 and summed in float32 (the
 * caller scales the score); otherwise the scaled float32 q against the converted row. */
static inline __attribute__((always_inline)) __m512 qk_partial(enum dtype t, int es, const char *q_raw,
                                                               const float *qf, const char *row, int D) {
    __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (t == BF16 && D % 32 == 0) {
#pragma GCC unroll 8
        for (int i = 0; i < D; i += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q_raw + 2 * i),
                                   (__m512bh)_mm512_loadu_si512(row + 2 * i));
        return acc;
    }
#endif
#pragma GCC unroll 16
    for (int i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), load16(t, row + i * es), acc);
    return acc;
}

static inline int qk_prescaled(enum dtype t, int D) {
#if defined(__AVX512BF16__)
    return !(t == BF16 && D % 32 == 0);
#else
    (void)t, (void)D;
    return 1;
#endif
}

/* The 16 lane sums of v[0..15], in order, for ~3 instructions a sum instead of a full horizontal
 * reduction each: halve 512 -> 256 -> 128 bits across pairs, then within 128-bit lanes; lane
 * 4k + m then holds the sum of v[4m + k], which the final permute puts in place. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 w[8], u[4], z[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}

/* s[g0 + g][j] for the G query heads of kv head kh and the n <= TILE positions of a tile. */
static inline __attribute__((always_inline)) void qk_tile(
    enum dtype t, int es, const char *q, int64_t q_sh, float (*qf)[MAXD], float (*s)[TILE], int g0, int G,
    const char *const *ks, int64_t k_sh, int n, int kh, int D, float scale, const char *const *nks, int nn) {
    const float post = qk_prescaled(t, D) ? 1.f : scale;
    for (int jb = 0; jb < n; jb += 16) {
        const int m = n - jb < 16 ? n - jb : 16;
        const char *rows[16];
        for (int j = 0; j < m; j++) rows[j] = ks[jb + j] + kh * k_sh * es;
        for (int j = jb; j < jb + 16 && j < nn; j++)
            for (int off = 0; off < D * es; off += 64) __builtin_prefetch(nks[j] + kh * k_sh * es + off, 0, 2);
        for (int g = g0; g < g0 + G; g++) {
            __m512 part[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                part[j] = j < m ? qk_partial(t, es, q + g * q_sh * es, qf[g], rows[j], D) : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(&s[g][jb], (__mmask16)((1u << m) - 1), _mm512_mul_ps(reduce16(part), _mm512_set1_ps(post)));
        }
    }
}

/* acc[g0 + g] += sum_j s[g0 + g][j] * V[t0 + j, kh] for the G query heads of kv head kh over one
 * tile, Dv = 16 * C. G and C are constants at every call, so the G * C accumulators stay in
 * registers across the tile instead of a load + store of acc per row (the V side was half the
 * kernel's instructions). bf16 rows are widened without a shuffle: each 32 values give their even
 * elements (shift left) and odd ones (mask) in two vectors, so acc holds each 32 columns as 16 even
 * then 16 odd (see pv_deinterleave); the cross-lane widening competed with the FMAs for a port. */
static inline __attribute__((always_inline)) void pv_tile(
    enum dtype t, int es, float (*acc)[MAXD], float (*s)[TILE], int g0, int G, int C, const char *const *vs,
    int64_t v_sh, int n, int kh, const char *const *nvs, int nn, const char *const *nks, int64_t k_sh, int D,
    int nnk) {
    __m512 a[4][8];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) a[g][c] = _mm512_loadu_ps(acc[g0 + g] + 16 * c);
    for (int j = 0; j < n; j++) {
        const char *row = vs[j] + kh * v_sh * es;
        if (j < nn)
#pragma GCC unroll 4
            for (int off = 0; off < 16 * C * es; off += 64) __builtin_prefetch(nvs[j] + kh * v_sh * es + off, 0, 2);
        if (j < nnk)
            for (int off = 0; off < D * es; off += 64) __builtin_prefetch(nks[j] + kh * k_sh * es + off, 0, 2);
        __m512 p[4];
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) p[g] = _mm512_set1_ps(s[g0 + g][j]);
        if (t == BF16) {
#pragma GCC unroll 4
            for (int c = 0; c < C; c += 2) {
                const __m512i x = _mm512_loadu_si512(row + 32 * c);
                const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
#pragma GCC unroll 4
                for (int g = 0; g < G; g++) {
                    a[g][c] = _mm512_fmadd_ps(p[g], ve, a[g][c]);
                    a[g][c + 1] = _mm512_fmadd_ps(p[g], vo, a[g][c + 1]);
                }
            }
            continue;
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) {
            const __m512 v = load16(t, row + 16 * c * es);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) a[g][c] = _mm512_fmadd_ps(p[g], v, a[g][c]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc[g0 + g] + 16 * c, a[g][c]);
}

/* Column order back from pv_tile's bf16 layout: row[32c + i] holds column 32c + 2i, row[32c + 16 + i]
 * column 32c + 2i + 1. */
static inline void pv_deinterleave(float *row, int Dv) {
    float tmp[MAXD];
    for (int c = 0; c < Dv; c += 32)
        for (int i = 0; i < 16; i++) tmp[c + 2 * i] = row[c + i], tmp[c + 2 * i + 1] = row[c + 16 + i];
    memcpy(row, tmp, (size_t)Dv * sizeof(float));
}
#else
#define HAVE_AVX512 0
#endif


#include "paged_attention_amx.h"

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
/* The same tiles in 8 lanes, for AVX2 CPUs (Zen 1-3, Haswell-Skylake client). */
/* s[g0 + g][j] for the G query heads of kv head kh and the n <= TILE positions of a tile; qf is
 * prescaled. Rows past n in the last group of 8 repeat the first row and are not stored. */
static inline __attribute__((always_inline)) void qk_tile8(
    enum dtype t, int es, float (*qf)[MAXD], float (*s)[TILE], int g0, int G, const char *const *ks, int64_t k_sh,
    int n, int kh, int D) {
    for (int jb = 0; jb < n; jb += 8) {
        const int m = n - jb < 8 ? n - jb : 8;
        const char *rows[8];
        for (int j = 0; j < 8; j++)
            rows[j] = ks[jb + (j < m ? j : 0)] + kh * k_sh * es;
        for (int g = g0; g < g0 + G; g++) {
            /* chunk-major: one load of q per chunk for the 8 rows, and 8 independent FMA chains */
            __m256 part[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) part[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
            for (int i = 0; i < D; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qf[g] + i);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) part[j] = _mm256_fmadd_ps(qv, load8(t, rows[j] + i * es), part[j]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, reduce8(part));
            for (int j = 0; j < m; j++) s[g][jb + j] = sums[j];
        }
    }
}

/* acc[g0 + g] += sum_j s[g0 + g][j] * V[t0 + j, kh] over one tile, Dv = 8 * C, in column chunks
 * of CC vectors so that the G * CC accumulators stay in the 16 ymm registers; G, CC and C are
 * constants at every call. */
static inline __attribute__((always_inline)) void pv_tile8(
    enum dtype t, int es, float (*acc)[MAXD], float (*s)[TILE], int g0, int G, int CC, int C,
    const char *const *vs, int64_t v_sh, int n, int kh) {
    const char *rows[TILE];
    for (int j = 0; j < n; j++) rows[j] = vs[j] + kh * v_sh * es;
    for (int c0 = 0; c0 < C; c0 += CC) {
        __m256 a[4][4];
#pragma GCC unroll 4
        for (int g = 0; g < G; g++)
#pragma GCC unroll 4
            for (int c = 0; c < CC; c++) a[g][c] = _mm256_loadu_ps(acc[g0 + g] + 8 * (c0 + c));
        for (int j = 0; j < n; j++) {
            __m256 p[4];
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) p[g] = _mm256_set1_ps(s[g0 + g][j]);
#pragma GCC unroll 4
            for (int c = 0; c < CC; c++) {
                const __m256 v = load8(t, rows[j] + 8 * (c0 + c) * es);
#pragma GCC unroll 4
                for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(p[g], v, a[g][c]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; g++)
#pragma GCC unroll 4
            for (int c = 0; c < CC; c++) _mm256_storeu_ps(acc[g0 + g] + 8 * (c0 + c), a[g][c]);
    }
}
#else
#define HAVE_AVX2 0
#endif

static inline void axpy(float *y, float a, const float *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* The work of one sequence; strides are in elements, es is the element size in bytes. The first
 * tile of the sequence this thread runs next (next_len > 0) is prefetched during the last tile. */
static inline __attribute__((always_inline)) void decode_one(
    enum dtype t, int es, const char *q, int64_t q_sh, const char *kc, int64_t k_sn, int64_t k_ss,
    int64_t k_sh, const char *vc, int64_t v_sn, int64_t v_ss, int64_t v_sh, const int32_t *table,
    int len, const int32_t *next_table, int next_len, const float *sinks, char *out, int64_t o_sh, int Hq,
    int Hkv, int D, int Dv, int bs, int window, float scale, int amx) {
    float qf[MAXHQ][MAXD], acc[MAXHQ][MAXD], s[MAXHQ][TILE], m[MAXHQ], l[MAXHQ], row[MAXD];
    const int G = Hq / Hkv;
    const int start = (window > 0 && len > window) ? len - window : 0;
    for (int h = 0; h < Hq; h++) {
        for (int d = 0; d < D; d++) qf[h][d] = load1(t, q + h * q_sh * es, d) * scale;
        memset(acc[h], 0, (size_t)Dv * sizeof(float));
        /* a sink starts the running max with mass exp(0) = 1 in the denominator */
        m[h] = sinks ? sinks[h] : -INFINITY;
        l[h] = sinks ? 1.f : 0.f;
    }
    const int64_t k_row = (int64_t)Hkv * k_sh * es, v_row = (int64_t)Hkv * v_sh * es;
    const char *slots[2][2][TILE]; /* [tile parity][K, V][position]: this tile's and the next's */
    /* The AVX-512 tiles prefetch the next tile's rows as they go, one row per row they read. Issued
     * all at once at a tile's start they bought nothing (bf16 B=64, caches of 30 layers: 1.44 ms a
     * call, 1.36 with no prefetch at all); spread over the tile, 1.02 ms. */
    const int fast = HAVE_AVX512 && D % 16 == 0 && (Dv == 64 || Dv == 128) && G <= 4;
    /* AMX QK (amx: the caller configured the tiles) where every tile starts on a 16-position boundary */
    const int use_amx = HAVE_AMX && amx && fast && start % 16 == 0;
    (void)use_amx;
#if HAVE_AMX
    uint32_t qt[AMX_QT][256] __attribute__((aligned(64)));
    if (use_amx) amx_load_q(qt, q, q_sh, Hq, G, D);
#endif
    if (start < len) {
        const int n0 = len - start < TILE ? len - start : TILE;
        tile_slots(kc, k_sn, k_ss, vc, v_sn, v_ss, table, start, n0, bs, es, slots[0][0], slots[0][1]);
        prefetch_rows(slots[0][0], n0, k_row);
        prefetch_rows(slots[0][1], n0, v_row);
    }
    for (int t0 = start, cur = 0; t0 < len; t0 += TILE, cur ^= 1) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        const int t1 = t0 + n, n1 = len - t1 < TILE ? len - t1 : TILE;
        const char *const *ks = slots[cur][0], *const *vs = slots[cur][1];
        /* the next tile's keys and values: a tile ahead, so the values' misses (issued after this
         * tile's softmax they stalled the V FMAs: perf, Zen AVX2) are served by the time they are read */
        int nn = 0; /* positions of the next tile (this sequence's or the next's) */
        if (n1 > 0) {
            tile_slots(kc, k_sn, k_ss, vc, v_sn, v_ss, table, t1, n1, bs, es, slots[cur ^ 1][0], slots[cur ^ 1][1]);
            nn = n1;
        } else if (next_len > 0) {
            const int s1 = (window > 0 && next_len > window) ? next_len - window : 0;
            nn = next_len - s1 < TILE ? next_len - s1 : TILE;
            tile_slots(kc, k_sn, k_ss, vc, v_sn, v_ss, next_table, s1, nn, bs, es, slots[cur ^ 1][0],
                       slots[cur ^ 1][1]);
        }
        const char *const *nks = slots[cur ^ 1][0], *const *nvs = slots[cur ^ 1][1];
        if (!fast && nn > 0) {
            prefetch_rows(nks, nn, k_row);
            prefetch_rows(nvs, nn, v_row);
        }
#if HAVE_AMX
        if (use_amx)
            qk_amx(s, ks, k_ss, k_sh, n, Hq, Hkv, D, scale);
        else
#endif
#if HAVE_AVX512
        if (D % 16 == 0)
            for (int kh = 0; kh < Hkv; kh++)
                qk_tile(t, es, q, q_sh, qf, s, kh * G, G, ks, k_sh, n, kh, D, scale, nks, fast ? nn : 0);
        else
#elif HAVE_AVX2
        if (D % 8 == 0)
            for (int kh = 0; kh < Hkv; kh++)
                qk_tile8(t, es, qf, s, kh * G, G, ks, k_sh, n, kh, D);
        else
#endif
        for (int j = 0; j < n; j++) {
            for (int kh = 0; kh < Hkv; kh++) {
                load_row(t, row, ks[j] + kh * k_sh * es, D);
                for (int g = kh * G; g < (kh + 1) * G; g++) s[g][j] = dot(qf[g], row, D);
            }
        }
        /* every softmax loop in simd form: the serial max and the per-head scalar exp were chains of
         * dependent scalar ops (perf: ~20% of the kernel at 9 heads, bf16, AVX-512) */
        float mxs[MAXHQ], alphas[MAXHQ];
        for (int h = 0; h < Hq; h++) {
            float mx = m[h];
#pragma omp simd reduction(max : mx)
            for (int j = 0; j < n; j++) mx = s[h][j] > mx ? s[h][j] : mx;
            mxs[h] = mx;
        }
#pragma omp simd
        for (int h = 0; h < Hq; h++) alphas[h] = fast_exp(m[h] - mxs[h]); /* 0 while m is -inf */
        for (int h = 0; h < Hq; h++) {
            const float mx = mxs[h], alpha = alphas[h];
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) {
                s[h][j] = fast_exp(s[h][j] - mx);
                sum += s[h][j];
            }
            l[h] = l[h] * alpha + sum;
            m[h] = mx;
            if (alpha != 1.f)
                for (int d = 0; d < Dv; d++) acc[h][d] *= alpha;
        }
#if HAVE_AVX512
        if ((Dv == 64 || Dv == 128) && G <= 4) {
            for (int kh = 0; kh < Hkv; kh++) {
#define PV(GC) pv_tile(t, es, acc, s, kh * G, GC, Dv / 16, vs, v_sh, n, kh, nvs, fast ? nn : 0, nks, k_sh, D, \
                           use_amx ? nn : 0)
                switch (G) {  /* literal G: see pv_tile */
                case 1: PV(1); break;
                case 2: PV(2); break;
                case 3: PV(3); break;
                default: PV(4); break;
                }
#undef PV
            }
            continue;
        }
#elif HAVE_AVX2
        if ((Dv == 64 || Dv == 128) && G <= 4) {
            for (int kh = 0; kh < Hkv; kh++) {
#define PV8(GC, CC) pv_tile8(t, es, acc, s, kh * G, GC, CC, Dv / 8, vs, v_sh, n, kh)
                switch (G) {  /* literal G and chunk: see pv_tile8 */
                case 1: PV8(1, 4); break;
                case 2: PV8(2, 4); break;
                case 3: PV8(3, 4); break;
                default: PV8(4, 2); break;
                }
#undef PV8
            }
            continue;
        }
#endif
        for (int j = 0; j < n; j++) {
            for (int kh = 0; kh < Hkv; kh++) {
                load_row(t, row, vs[j] + kh * v_sh * es, Dv);
                for (int g = kh * G; g < (kh + 1) * G; g++) axpy(acc[g], s[g][j], row, Dv);
            }
        }
    }
#if HAVE_AVX512
    if (t == BF16 && (Dv == 64 || Dv == 128) && G <= 4)  /* pv_tile's bf16 layout */
        for (int h = 0; h < Hq; h++) pv_deinterleave(acc[h], Dv);
#endif
    for (int h = 0; h < Hq; h++)  /* nothing visible (l == 0): zeros */
        store_row(t, out + h * o_sh * es, acc[h], l[h] > 0.f ? 1.f / l[h] : 0.f, Dv);
}

#if !HAVE_AMX
#define amx_applies(t, Hq, Hkv, D, bs) 0
#define amx_configure(Hq, nq) (void)0
#define _tile_release() (void)0
#endif

#endif
