/* Varlen causal prefill attention for CPUs: every prefill chunk of a step in one call, K/V read
 * straight from the paged cache (this step's tokens already written there), so prompts, chunks
 * over cached context and prefix-cache hits are one case. Float32 accumulation, online softmax
 * over tiles of KT key positions (flash attention).
 *
 * Layouts and semantics are those of kernels/prefill_attention.py (its torch reference is the
 * spec): q [T, Hq, D] and out [T, Hq, Dv] rows q_start[s] .. q_start[s] + q_len[s] are the last
 * q_len[s] positions of a context of seq_lens[s] tokens; caches [N, bs, Hkv, D*] (last dim
 * contiguous), block_tables [S, *] int32; optional sliding window W > 0 (position p sees keys
 * (p - W, p]) and sinks [Hq] float32 (one more logit per head, with a zero value).
 *
 * A task is (sequence, kv head, tile of query positions): its M rows are the tile's positions
 * times the G = Hq / Hkv query heads of the kv head, position-major, so each packed key tile
 * serves all of them. Key tiles start at multiples of KT from position 0, and each row's sums run
 * in the same order whatever else the call holds: a row's result does not depend on the batch.
 * The step's key/value tiles are packed once (float32, or bf16 pairs for the bf16 paths) before
 * the tasks run. bf16 with AMX: q.k and p.v on tiles of 16 rows (p rounded to bf16, as torch's
 * flash kernel does); bf16 with AVX512-BF16 only: q.k on vdpbf16ps (p . v stays float32: p rounded
 * to bf16 there too moved the quality gate's bf16 PPL from +0.57% to +1.21% of HF fp32's).
 * Otherwise the dots are register-blocked RB rows x KT keys (q.k: keys across lanes, K transposed
 * at packing) and PB rows x 64 value columns (p.v) in GCC vector extensions of 16 floats: one zmm
 * with AVX-512, split into ymm / xmm halves by the compiler on smaller CPUs.
 */
#if defined(__AVX512F__)
/* GCC vectorizes `omp simd` loops (the softmax's exp) 8 lanes wide on CPUs it tunes for 256 bits
 * unless told otherwise; here the loops are 16 or 32 wide. */
#pragma GCC target("prefer-vector-width=512")
#include <immintrin.h>
#endif
#include <stdlib.h>

#include "cpu_common.h"

#define KT 32     /* key positions per tile */
#define MROWS 128 /* target rows (positions x heads of a group) per task */
#define RB 8      /* rows per register block of q.k, and the row alignment of a tile's rows */
#define PB 4      /* rows per register block of p.v (4 x 64 columns: 16 accumulators) */
#define VW 16     /* floats per vector */
#define MAXD 512

typedef float vf __attribute__((vector_size(64)));
typedef float vf_unaligned __attribute__((vector_size(64), aligned(4)));

/* Per-thread scratch, 64-byte aligned float arrays. */
struct scratch {
    float *q;     /* [Mp][D] scaled queries (bf16 pairs on the vdpbf16ps path) */
    float *s;     /* [Mp][KT] scores, then probabilities */
    float *p16;   /* [Mp][KT] bf16 probabilities (the AMX path) */
    float *o;     /* [Mp][Dvp] unnormalized outputs */
    float *m, *alpha; /* [Mp] running max, this tile's rescale */
    vf *l;            /* [Mp] running sum, lane-wise */
};

static inline size_t up64(size_t n) { return (n + 15) & ~(size_t)15; }

static int scratch_alloc(struct scratch *w, int Mp, int D, int Dvp) {
    const size_t n[7] = {up64((size_t)Mp * D), up64((size_t)Mp * KT), up64((size_t)Mp * KT / 2),
                         up64((size_t)Mp * Dvp), up64(Mp), up64((size_t)Mp * VW), up64(Mp)};
    size_t total = 0;
    for (int i = 0; i < 7; i++) total += n[i];
    float *p = aligned_alloc(64, total * sizeof(float));
    if (!p) return 1;
    float *l, **dst[7] = {&w->q, &w->s, &w->p16, &w->o, &w->m, &l, &w->alpha};
    for (int i = 0; i < 7; i++) *dst[i] = p, p += n[i];
    w->l = (vf *)l;
    return 0;
}

/* s[r][0..KT) = q[r] . kt[.][0..KT) for rows [m0, m1), m1 - m0 a multiple of RB. */
static inline __attribute__((always_inline)) void qk_tile(const float *q, const float *kt, float *s, int m0,
                                                          int m1, int D) {
    for (int mb = m0; mb < m1; mb += RB) {
        vf acc[RB][2] = {0};
        const float *qr = q + (size_t)mb * D;
        for (int d = 0; d < D; d++) {
            const vf k0 = *(const vf *)(kt + d * KT), k1 = *(const vf *)(kt + d * KT + VW);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const float x = qr[r * D + d];
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
            }
        }
        for (int r = 0; r < RB; r++) {
            *(vf *)(s + (mb + r) * KT) = acc[r][0];
            *(vf *)(s + (mb + r) * KT + VW) = acc[r][1];
        }
    }
}

/* o[r][c0 .. c0 + NC * VW) = o[r] * alpha[r] + p[r][0..n) . v[0..n) for rows [mb, mb + PB); NC a
 * literal at each call, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_block(const float *p, const float *v, const float *alpha,
                                                           float *o, int mb, int c0, int n, int Dvp, const int NC) {
    vf acc[PB][NC];
    for (int r = 0; r < PB; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = *(const vf *)(o + (size_t)(mb + r) * Dvp + c0 + c * VW) * alpha[mb + r];
    for (int j = 0; j < n; j++) {
        const float *vr = v + (size_t)j * Dvp + c0;
#pragma GCC unroll 4
        for (int r = 0; r < PB; r++) {
            const float x = p[(mb + r) * KT + j];
            for (int c = 0; c < NC; c++) acc[r][c] += x * *(const vf *)(vr + c * VW);
        }
    }
    for (int r = 0; r < PB; r++)
        for (int c = 0; c < NC; c++) *(vf *)(o + (size_t)(mb + r) * Dvp + c0 + c * VW) = acc[r][c];
}

/* o[r] = o[r] * alpha[r] + p[r][0..n) . v[0..n) for rows [m0, m1), in column chunks of 4 vectors. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const float *v, const float *alpha,
                                                          float *o, int m0, int m1, int n, int Dvp) {
    for (int mb = m0; mb < m1; mb += PB) {
        int c0 = 0;
        for (; c0 + 4 * VW <= Dvp; c0 += 4 * VW) pv_block(p, v, alpha, o, mb, c0, n, Dvp, 4);
        for (; c0 < Dvp; c0 += VW) pv_block(p, v, alpha, o, mb, c0, n, Dvp, 1);
    }
}

/* The largest lane of v; a shuffle tree on AVX-512 (a reduction loop became a serial chain). */
INLINE float vmax_lanes(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    float r = v[0];
    for (int i = 1; i < VW; i++) r = v[i] > r ? v[i] : r;
    return r;
#endif
}

INLINE float vsum_lanes(vf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float r = 0.f;
    for (int i = 0; i < VW; i++) r += v[i];
    return r;
#endif
}

#if defined(__AVX512F__)
/* exp(x) for 16 lanes as 2^n * 2^f, n = round(x log2 e), |f| <= 1/2: a degree-6 Taylor polynomial
 * of e^(f ln 2) (relative error < 2e-7) scaled by vscalefps (inf above), with half the instructions
 * of fast_exp. Below 2^-126 it gives 0, as fast_exp does, and by a mask: a denormal result, even
 * one that rounds to zero, costs a microcode assist (masked diagonal tiles were 1.6x slower). */
INLINE __m512 exp16(__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.f), _CMP_GT_OQ), p, n);
}
#endif

/* Online-softmax update of a row's running max m and lane-wise running sum l (summed at the end)
 * for scores s[lo..hi) of this tile (the rest are hidden from it): s becomes the probabilities
 * (zeros outside [lo, hi)), alpha the rescale of what the row accumulated before. */
static inline __attribute__((always_inline)) void softmax_row(float *s, int lo, int hi, float *m, vf *l,
                                                              float *alpha) {
    if (lo >= hi) {
        for (int j = 0; j < KT; j++) s[j] = 0.f;
        *alpha = 1.f;
        return;
    }
    if (lo > 0 || hi < KT) {
#pragma omp simd
        for (int j = 0; j < KT; j++) s[j] = j >= lo && j < hi ? s[j] : -INFINITY;
    }
    const vf a = *(vf *)s, b = *(vf *)(s + VW);
#if defined(__AVX512F__)
    const float top = vmax_lanes((vf)_mm512_max_ps((__m512)a, (__m512)b));
#else
    float top = -INFINITY;
    for (int i = 0; i < VW; i++) top = a[i] > top ? a[i] : top, top = b[i] > top ? b[i] : top;
#endif
    const float mx = top > *m ? top : *m;
#if defined(__AVX512F__)
    for (int j = 0; j < KT; j += VW)
        _mm512_store_ps(s + j, exp16(_mm512_sub_ps(_mm512_load_ps(s + j), _mm512_set1_ps(mx))));
#else
#pragma omp simd
    for (int j = 0; j < KT; j++) s[j] = fast_exp(s[j] - mx); /* exp(-inf) = 0 */
#endif
    *alpha = fast_exp(*m - mx); /* 0 while m is -inf */
    *l = *l * *alpha + *(vf *)s + *(vf *)(s + VW);
    *m = mx;
}

/* softmax_row for rows [m0, m1) that all see every key of the tile (the tiles below the diagonal,
 * most of a long prompt's): with the bounds constant, no masks or branches are left, and the rows'
 * reduce / exp chains overlap. */
static inline __attribute__((always_inline)) void softmax_full(float *s, int m0, int m1, float *m, vf *l,
                                                               float *alpha) {
#pragma GCC unroll 4
    for (int r = m0; r < m1; r++) softmax_row(s + (size_t)r * KT, 0, KT, m + r, l + r, alpha + r);
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define QK_BF16 1
/* qk_tile for bf16 on vdpbf16ps: q rows and the key tile hold raw bf16 pairs ([D/2][KT][2] for
 * the tile); products are exact in float32 and summed in float32, then scaled. */
static inline __attribute__((always_inline)) void qk_tile_bf16(const uint16_t *q, const uint16_t *kt, float *s,
                                                               int m0, int m1, int D, float scale) {
    for (int mb = m0; mb < m1; mb += RB) {
        __m512 acc[RB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint32_t *qr = (const uint32_t *)(q + (size_t)mb * D);
        for (int dp = 0; dp < D / 2; dp++) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + dp * 2 * KT);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + dp * 2 * KT + 32);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qr[r * D / 2 + dp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k1);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale);
        for (int r = 0; r < RB; r++) {
            _mm512_store_ps(s + (mb + r) * KT, _mm512_mul_ps(acc[r][0], sc));
            _mm512_store_ps(s + (mb + r) * KT + VW, _mm512_mul_ps(acc[r][1], sc));
        }
    }
}
#else
#define QK_BF16 0
#endif

#if QK_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_common.h"
#define HAVE_AMX 1
#define AMX_ROWS 16 /* rows per tile: the row block of the AMX path */

/* Every tile 16 rows of 64 bytes: tmm0/1 scores (16 rows x 16 keys each), tmm2 q (16 rows x 32
 * dims), tmm3/4 keys (16 dim pairs x 16 keys), tmm5 outputs (16 rows x 16 columns), tmm6
 * probabilities (16 rows x 32 keys), tmm7 values (16 key pairs x 16 columns). */
static void amx_configure(void) {
    tilecfg_t cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* s = scale * q . k for rows [m0, m1) (multiples of 16); q rows raw bf16 [Mp][D], D a multiple of
 * 32, the key tile [D/2][KT][2] raw bf16. */
static inline void qk_tile_amx(const uint16_t *q, const uint16_t *kt, float *s, int m0, int m1, int D,
                               float scale) {
    for (int mb = m0; mb < m1; mb += AMX_ROWS) {
        _tile_zero(0);
        _tile_zero(1);
        for (int d0 = 0; d0 < D; d0 += 32) {
            _tile_loadd(2, q + (size_t)mb * D + d0, D * 2);
            _tile_loadd(3, kt + (size_t)d0 * KT, KT * 4);
            _tile_loadd(4, kt + (size_t)d0 * KT + 32, KT * 4);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, s + (size_t)mb * KT, KT * 4);
        _tile_stored(1, s + (size_t)mb * KT + 16, KT * 4);
    }
    const vf sc = (vf){0} + scale;
    for (int i = m0 * KT; i < m1 * KT; i += VW) *(vf *)(s + i) *= sc;
}

/* o[r] = o[r] * alpha[r] + p[r] . v for rows [m0, m1): p as bf16 [Mp][KT] (rounded from s here),
 * the value tile [KT/2][Dvp][2] raw bf16. */
static inline void pv_tile_amx(const float *s, uint16_t *p16, const uint16_t *v, const float *alpha, float *o,
                               int m0, int m1, int Dvp) {
    for (int m = m0; m < m1; m++) {
        if (alpha[m] != 1.f) { /* the running max moved */
            const vf a = (vf){0} + alpha[m];
            for (int c = 0; c < Dvp; c += VW) *(vf *)(o + (size_t)m * Dvp + c) *= a;
        }
        for (int j = 0; j < KT; j += 16)
            _mm256_store_si256((__m256i *)(p16 + (size_t)m * KT + j),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(s + (size_t)m * KT + j)));
    }
    for (int mb = m0; mb < m1; mb += AMX_ROWS) {
        _tile_loadd(6, p16 + (size_t)mb * KT, KT * 2);
        for (int c = 0; c < Dvp; c += 16) {
            _tile_loadd(5, o + (size_t)mb * Dvp + c, Dvp * 4);
            _tile_loadd(7, v + (size_t)c * 2, Dvp * 4);
            _tile_dpbf16ps(5, 6, 7);
            _tile_stored(5, o + (size_t)mb * Dvp + c, Dvp * 4);
        }
    }
}
#else
#define HAVE_AMX 0
#define AMX_ROWS RB
#define amx_permitted() 0
#endif

struct args {
    const char *q, *kc, *vc;
    int64_t q_st, q_sh, k_sn, k_ss, k_sh, v_sn, v_ss, v_sh, bt_sb, o_st, o_sh;
    const int32_t *bt, *q_start, *q_len, *seq_lens;
    const float *sinks;
    char *out;
    int Hq, Hkv, D, Dv, bs, window;
    float scale;
};

/* The step's key/value tiles, packed once for every query tile that reads them: tile tt of
 * sequence s and kv head h at tiles + (off[s] + (tt - first[s]) * Hkv + h) * tile_floats, its
 * transposed keys ([D][KT] float32, or [D/2][KT][2] raw bf16 when qk_tile_bf16 runs) then its
 * values ([KT][Dvp] float32, zero past the context and past Dv). */
struct packed {
    float *tiles;
    const int *off, *first;
    int64_t tile_floats;
    int Dvp, bf16_pairs, amx; /* amx: values packed [KT/2][Dvp][2] raw bf16 too */
};

static inline const float *tile_at(const struct packed *pk, int s, int h, int Hkv, int tt) {
    return pk->tiles + ((int64_t)pk->off[s] + (int64_t)(tt - pk->first[s]) * Hkv + h) * pk->tile_floats;
}

static inline __attribute__((always_inline)) void pack_tile(enum dtype t, int es, const struct args *a,
                                                            const struct packed *pk, int s, int h, int tt) {
    const int D = a->D, Dv = a->Dv, Dvp = pk->Dvp, L = a->seq_lens[s], t0 = tt * KT;
    const int n = L - t0 < KT ? L - t0 : KT;
    float *kt = (float *)tile_at(pk, s, h, a->Hkv, tt), *v = kt + (int64_t)D * KT;
    const int32_t *table = a->bt + (int64_t)s * a->bt_sb;
    int blk = t0 / a->bs, off = t0 % a->bs;
    for (int j = 0; j < KT; j++) {
        float *vr = v + (size_t)j * Dvp;
        if (j < n) {
            const int64_t page = table[blk];
            const char *kr = a->kc + (page * a->k_sn + off * a->k_ss + h * a->k_sh) * es;
            const char *vs = a->vc + (page * a->v_sn + off * a->v_ss + h * a->v_sh) * es;
            if (pk->bf16_pairs) {
                uint32_t *kp = (uint32_t *)kt;
                const uint32_t *src = (const uint32_t *)kr;
                for (int dp = 0; dp < D / 2; dp++) kp[dp * KT + j] = src[dp];
            } else {
                for (int d = 0; d < D; d++) kt[d * KT + j] = load1(t, kr, d);
            }
            if (pk->amx) {
                uint16_t *vp = (uint16_t *)v + (size_t)(j / 2) * Dvp * 2 + j % 2;
                const uint16_t *src = (const uint16_t *)vs;
                for (int c = 0; c < Dv; c++) vp[2 * c] = src[c];
                for (int c = Dv; c < Dvp; c++) vp[2 * c] = 0;
            } else if (t == F32) { /* load_row's memcpy became an 8-byte loop: runtime length */
                int c = 0;
                for (; c + VW <= Dv; c += VW) *(vf *)(vr + c) = *(const vf_unaligned *)((const float *)vs + c);
                for (; c < Dv; c++) vr[c] = ((const float *)vs)[c];
            } else {
                load_row(t, vr, vs, Dv);
            }
            if (++off == a->bs) off = 0, blk++;
        } else {
            if (pk->bf16_pairs)
                for (int dp = 0; dp < D / 2; dp++) ((uint32_t *)kt)[dp * KT + j] = 0;
            else
                for (int d = 0; d < D; d++) kt[d * KT + j] = 0.f;
            if (pk->amx) {
                uint16_t *vp = (uint16_t *)v + (size_t)(j / 2) * Dvp * 2 + j % 2;
                for (int c = 0; c < Dvp; c++) vp[2 * c] = 0;
            } else {
                memset(vr, 0, (size_t)Dv * sizeof(float));
            }
        }
        if (!pk->amx)
            for (int c = Dv; c < Dvp; c++) vr[c] = 0.f;
    }
}

/* Task (s, kv head h, query positions [i0, i0 + ni) of the chunk). */
static inline __attribute__((always_inline)) void prefill_task(enum dtype t, int es, const struct args *a,
                                                               const struct packed *pk, struct scratch *w,
                                                               int s, int h, int i0, int ni) {
    const int G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, Dvp = pk->Dvp, W = a->window;
    const int rb = pk->amx ? AMX_ROWS : RB, M = ni * G, Mp = (M + rb - 1) / rb * rb;
    const int base = a->seq_lens[s] - a->q_len[s] + i0; /* position of the task's first query */
    for (int m = 0; m < Mp; m++) {
        const char *src = a->q + ((int64_t)(a->q_start[s] + i0 + m / G) * a->q_st + (int64_t)(h * G + m % G) * a->q_sh) * es;
        if (pk->bf16_pairs) {
            uint16_t *qr = (uint16_t *)w->q + (size_t)m * D;
            if (m < M) memcpy(qr, src, (size_t)D * 2);
            else memset(qr, 0, (size_t)D * 2);
        } else {
            float *qr = w->q + (size_t)m * D;
            if (m < M) {
#pragma omp simd
                for (int d = 0; d < D; d++) qr[d] = load1(t, src, d) * a->scale;
            } else {
                memset(qr, 0, (size_t)D * sizeof(float));
            }
        }
        /* A sink starts the running max at its logit with mass exp(0) = 1 in the sum. */
        w->m[m] = a->sinks && m < M ? a->sinks[h * G + m % G] : -INFINITY;
        w->l[m] = (vf){a->sinks && m < M ? 1.f : 0.f};
        memset(w->o + (size_t)m * Dvp, 0, (size_t)Dvp * sizeof(float));
    }
    const int last = base + ni - 1;
    const int first = W > 0 && base - W + 1 > 0 ? base - W + 1 : 0;
    for (int t0 = first / KT * KT; t0 <= last; t0 += KT) {
        const int n = last + 1 - t0 < KT ? last + 1 - t0 : KT;
        /* Rows that see some key of the tile: positions in [t0, t0 + n - 1 + W). */
        int p0 = t0 - base > 0 ? t0 - base : 0, p1 = ni;
        if (W > 0 && t0 + n - 1 + W - base < p1) p1 = t0 + n - 1 + W - base;
        if (p1 <= p0) continue;
        const int m0 = p0 * G / rb * rb, m1 = (p1 * G + rb - 1) / rb * rb;
        const float *kt = tile_at(pk, s, h, a->Hkv, t0 / KT), *v = kt + (int64_t)D * KT;
#if HAVE_AMX
        if (pk->amx)
            qk_tile_amx((const uint16_t *)w->q, (const uint16_t *)kt, w->s, m0, m1, D, a->scale);
        else
#endif
#if QK_BF16
        if (pk->bf16_pairs)
            qk_tile_bf16((const uint16_t *)w->q, (const uint16_t *)kt, w->s, m0, m1, D, a->scale);
        else
#endif
            qk_tile(w->q, kt, w->s, m0, m1, D);
        /* every row of [m0, m1) a real one whose position is past the tile and inside its window */
        const int full = n == KT && m1 <= M && base + m0 / G >= t0 + KT - 1 &&
                         (W <= 0 || base + (m1 - 1) / G - W + 1 <= t0);
        if (full) {
            softmax_full(w->s, m0, m1, w->m, w->l, w->alpha);
        } else {
            for (int m = m0; m < m1; m++) {
                int lo = 0, hi = 0;
                if (m < M) {
                    const int pos = base + m / G;
                    hi = pos - t0 + 1 < n ? pos - t0 + 1 : n;
                    if (W > 0 && pos - W + 1 - t0 > 0) lo = pos - W + 1 - t0;
                }
                softmax_row(w->s + (size_t)m * KT, lo, hi, w->m + m, w->l + m, w->alpha + m);
            }
        }
#if HAVE_AMX
        if (pk->amx)
            pv_tile_amx(w->s, (uint16_t *)w->p16, (const uint16_t *)v, w->alpha, w->o, m0, m1, Dvp);
        else
#endif
            pv_tile(w->s, v, w->alpha, w->o, m0, m1, n, Dvp);
    }
    for (int m = 0; m < M; m++) {
        char *dst = a->out + ((int64_t)(a->q_start[s] + i0 + m / G) * a->o_st + (int64_t)(h * G + m % G) * a->o_sh) * es;
        const float l = vsum_lanes(w->l[m]);
        store_row(t, dst, w->o + (size_t)m * Dvp, l > 0.f ? 1.f / l : 0.f, Dv);
    }
}

/* Compute tasks (s, kv head, first query of the tile) and pack tasks (s, kv head, key tile), three
 * ints each, and the packed layout's per-sequence offsets; returns 0, or 2 when out of memory. */
static int plan(const struct args *a, int nseq, int qt, int **tasks, int *n_tasks, int **packs, int *n_packs,
                int **off_first) {
    int n = 0, np = 0;
    int *of = malloc((size_t)(2 * nseq + 1) * sizeof(int));
    if (!of) return 2;
    for (int s = 0; s < nseq; s++) {
        const int ctx0 = a->seq_lens[s] - a->q_len[s];
        const int first = a->window > 0 && ctx0 - a->window + 1 > 0 ? (ctx0 - a->window + 1) / KT : 0;
        of[s] = np, of[nseq + s] = first;
        n += (a->q_len[s] + qt - 1) / qt * a->Hkv;
        np += ((a->seq_lens[s] + KT - 1) / KT - first) * a->Hkv;
    }
    int *tk = malloc((size_t)(n + 1) * 3 * sizeof(int)), *pk = malloc((size_t)(np + 1) * 3 * sizeof(int));
    if (!tk || !pk) {
        free(of), free(tk), free(pk);
        return 2;
    }
    int k = 0, kp = 0;
    for (int s = 0; s < nseq; s++) {
        /* The last query tile first: it reads the most keys (a long task late would run alone). */
        for (int i0 = (a->q_len[s] - 1) / qt * qt; i0 >= 0; i0 -= qt)
            for (int h = 0; h < a->Hkv; h++) tk[k++] = s, tk[k++] = h, tk[k++] = i0;
        for (int tt = of[nseq + s]; tt < (a->seq_lens[s] + KT - 1) / KT; tt++)
            for (int h = 0; h < a->Hkv; h++) pk[kp++] = s, pk[kp++] = h, pk[kp++] = tt;
    }
    *tasks = tk, *n_tasks = n, *packs = pk, *n_packs = np, *off_first = of;
    return 0;
}

static int prefill(enum dtype t, const struct args *a, int nseq) {
    const int G = a->Hq / a->Hkv, qt = MROWS / G > 0 ? MROWS / G : 1;
    const int Dvp = (a->Dv + VW - 1) / VW * VW;
    const int amx = HAVE_AMX && t == BF16 && a->D % 32 == 0 && amx_permitted();
    const int rb = amx ? AMX_ROWS : RB, Mp = (qt * G + rb - 1) / rb * rb;
    int *tasks, *packs, *of, n, np;
    if (plan(a, nseq, qt, &tasks, &n, &packs, &np, &of)) return 2;
    struct packed pk = {NULL, of, of + nseq, (int64_t)a->D * KT + (int64_t)KT * Dvp, Dvp,
                        QK_BF16 && t == BF16 && a->D % 2 == 0, amx};
    pk.tiles = aligned_alloc(64, ((size_t)np * pk.tile_floats + 16) * sizeof(float));
    int failed = !pk.tiles;
#pragma omp parallel if (n > 1) shared(failed)
    {
        struct scratch w = {0};
        const int ok = !failed && !scratch_alloc(&w, Mp, a->D, Dvp);
#if HAVE_AMX
        if (amx) amx_configure();
#endif
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int k = 0; k < np; k++)
            if (!failed) WITH_DTYPE(t, pack_tile(t_, es_, a, &pk, packs[3 * k], packs[3 * k + 1], packs[3 * k + 2]));
#pragma omp for schedule(dynamic, 1)
        for (int k = 0; k < n; k++) {
            if (failed) continue;
            const int s = tasks[3 * k], h = tasks[3 * k + 1], i0 = tasks[3 * k + 2];
            const int ni = a->q_len[s] - i0 < qt ? a->q_len[s] - i0 : qt;
            WITH_DTYPE(t, prefill_task(t_, es_, a, &pk, &w, s, h, i0, ni));
        }
        free(w.q);
#if HAVE_AMX
        if (amx) _tile_release(); /* torch's own AMX kernels configure their tiles afresh */
#endif
    }
    free(pk.tiles), free(tasks), free(packs), free(of);
    return failed ? 2 : 0;
}

/* Returns 0 on success, 1 when a shape is outside the kernel's limits, 2 when out of memory
 * (the caller falls back to the reference either way). */
#define DEFINE_PREFILL(NAME, DT, ES)                                                                        \
    int NAME(const void *q, int64_t q_st, int64_t q_sh, const void *kc, int64_t k_sn, int64_t k_ss,        \
             int64_t k_sh, const void *vc, int64_t v_sn, int64_t v_ss, int64_t v_sh, const int32_t *bt,    \
             int64_t bt_sb, const int32_t *q_start, const int32_t *q_len, const int32_t *seq_lens,          \
             const float *sinks, void *out, int64_t o_st, int64_t o_sh, int nseq, int Hq, int Hkv, int D,  \
             int Dv, int bs, int window, float scale) {                                                     \
        if (Hkv <= 0 || Hq % Hkv || D > MAXD || Dv > MAXD || D <= 0 || Dv <= 0) return 1;                  \
        const struct args a = {q, kc, vc, q_st, q_sh, k_sn, k_ss, k_sh, v_sn, v_ss, v_sh, bt_sb, o_st,     \
                               o_sh, bt, q_start, q_len, seq_lens, sinks, out, Hq, Hkv, D, Dv, bs, window, \
                               scale};                                                                      \
        return prefill(DT, &a, nseq);                                                                   \
    }

DEFINE_PREFILL(prefill_attention_f32, F32, 4)
DEFINE_PREFILL(prefill_attention_bf16, BF16, 2)
DEFINE_PREFILL(prefill_attention_f16, F16, 2)
