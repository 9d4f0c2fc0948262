/* Paged decode attention for CPUs: one query token per sequence, read straight from the paged
 * cache (no gather copy), float32 accumulation, online softmax over tiles of TILE positions.
 *
 * Layouts and semantics are those of kernels/paged_attention.py (its torch reference is the
 * spec): q [B, Hq, D], caches [N, bs, Hkv, D*] (last dim contiguous), block_tables [B, *] int32,
 * seq_lens [B] int32, optional sinks [Hq] float32, sliding window W > 0 keeps p >= len - W.
 * One task per sequence, all heads together: a cache slot's Hkv rows are adjacent, so a task
 * streams whole pages. The G = Hq / Hkv query heads of a kv head share each K/V row, which is
 * converted to float32 once.
 */
#include "cpu_common.h"

#define MAXHQ 64
#define MAXD 256
#define TILE 32

/* Pages are scattered, so the hardware stream prefetchers (which stop at 4 KiB boundaries) keep
 * restarting; ask for the rows of positions [p0, p1) ahead of use instead. */
static inline void prefetch_rows(const char *cache, int64_t sn, int64_t ss, int64_t row_bytes, const int32_t *table,
                                 int p0, int p1, int bs, int es) {
    for (int pos = p0; pos < p1; pos++) {
        const char *r = cache + ((int64_t)table[pos / bs] * sn + (pos % bs) * ss) * es;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
    }
}

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16 rows straight into vdpbf16ps: products of bf16 are exact in float32 and summed in float32,
 * so this matches converting first, at half the instructions and no conversion (n % 32 == 0). */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    return _mm512_reduce_add_ps(acc);
}
#define HAVE_DOT_BF16 1
#else
#define HAVE_DOT_BF16 0
#endif

static inline void axpy(float *y, float a, const float *x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* The work of one sequence; strides are in elements, es is the element size in bytes. */
static inline __attribute__((always_inline)) void decode_one(
    enum dtype t, int es, const char *q, int64_t q_sh, const char *kc, int64_t k_sn, int64_t k_ss,
    int64_t k_sh, const char *vc, int64_t v_sn, int64_t v_ss, int64_t v_sh, const int32_t *table,
    int len, const float *sinks, char *out, int64_t o_sh, int Hq, int Hkv, int D, int Dv, int bs,
    int window, float scale) {
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
    prefetch_rows(kc, k_sn, k_ss, k_row, table, start, len < start + TILE ? len : start + TILE, bs, es);
    for (int t0 = start; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? len - t0 : TILE;
        const int t1 = t0 + n, t2 = len < t1 + TILE ? len : t1 + TILE;
        prefetch_rows(vc, v_sn, v_ss, v_row, table, t0, t1, bs, es);  /* used after this tile's softmax */
        prefetch_rows(kc, k_sn, k_ss, k_row, table, t1, t2, bs, es);  /* the next tile's keys */
        for (int j = 0; j < n; j++) {
            const int pos = t0 + j;
            const char *slot = kc + ((int64_t)table[pos / bs] * k_sn + (pos % bs) * k_ss) * es;
            for (int kh = 0; kh < Hkv; kh++) {
#if HAVE_DOT_BF16
                if (t == BF16 && D % 32 == 0) {  /* unscaled bf16 q, scale applied to the score */
                    const uint16_t *kr = (const uint16_t *)(slot + kh * k_sh * es);
                    for (int g = kh * G; g < (kh + 1) * G; g++)
                        s[g][j] = scale * dot_bf16((const uint16_t *)(q + g * q_sh * es), kr, D);
                    continue;
                }
#endif
                load_row(t, row, slot + kh * k_sh * es, D);
                for (int g = kh * G; g < (kh + 1) * G; g++) s[g][j] = dot(qf[g], row, D);
            }
        }
        for (int h = 0; h < Hq; h++) {
            float mx = m[h];
            for (int j = 0; j < n; j++) mx = s[h][j] > mx ? s[h][j] : mx;
            const float alpha = fast_exp(m[h] - mx); /* 0 while m is -inf */
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
        for (int j = 0; j < n; j++) {
            const int pos = t0 + j;
            const char *slot = vc + ((int64_t)table[pos / bs] * v_sn + (pos % bs) * v_ss) * es;
            for (int kh = 0; kh < Hkv; kh++) {
                load_row(t, row, slot + kh * v_sh * es, Dv);
                for (int g = kh * G; g < (kh + 1) * G; g++) axpy(acc[g], s[g][j], row, Dv);
            }
        }
    }
    for (int h = 0; h < Hq; h++)  /* nothing visible (l == 0): zeros */
        store_row(t, out + h * o_sh * es, acc[h], l[h] > 0.f ? 1.f / l[h] : 0.f, Dv);
}

/* Returns 0 on success, 1 when a shape is outside the kernel's limits (caller falls back). */
#define DEFINE_PAGED_DECODE(NAME, DT, ES)                                                             \
    int NAME(const void *q, int64_t q_sb, int64_t q_sh, const void *kc, int64_t k_sn, int64_t k_ss, \
             int64_t k_sh, const void *vc, int64_t v_sn, int64_t v_ss, int64_t v_sh,               \
             const int32_t *bt, int64_t bt_sb, const int32_t *seq_lens, const float *sinks,         \
             void *out, int64_t o_sb, int64_t o_sh, int B, int Hq, int Hkv, int D, int Dv, int bs,  \
             int window, float scale) {                                                              \
        if (Hq > MAXHQ || D > MAXD || Dv > MAXD || Hq % Hkv) return 1;                              \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int b = 0; b < B; b++) {               \
            const char *qb = (const char *)q + b * q_sb * ES;                                           \
            char *ob = (char *)out + b * o_sb * ES;                                                      \
            /* constant head dims let the compiler unroll the row loops fully (~1.5x) */                \
            if (D == 64 && Dv == 64)                                                                     \
                decode_one(DT, ES, qb, q_sh, kc, k_sn, k_ss, k_sh, vc, v_sn, v_ss, v_sh, bt + b * bt_sb, \
                           seq_lens[b], sinks, ob, o_sh, Hq, Hkv, 64, 64, bs, window, scale);            \
            else if (D == 128 && Dv == 128)                                                              \
                decode_one(DT, ES, qb, q_sh, kc, k_sn, k_ss, k_sh, vc, v_sn, v_ss, v_sh, bt + b * bt_sb, \
                           seq_lens[b], sinks, ob, o_sh, Hq, Hkv, 128, 128, bs, window, scale);          \
            else                                                                                         \
                decode_one(DT, ES, qb, q_sh, kc, k_sn, k_ss, k_sh, vc, v_sn, v_ss, v_sh, bt + b * bt_sb, \
                           seq_lens[b], sinks, ob, o_sh, Hq, Hkv, D, Dv, bs, window, scale);             \
        }                                                                                                \
        return 0;                                                                                    \
    }

DEFINE_PAGED_DECODE(paged_decode_f32, F32, 4)
DEFINE_PAGED_DECODE(paged_decode_bf16, BF16, 2)
DEFINE_PAGED_DECODE(paged_decode_f16, F16, 2)
