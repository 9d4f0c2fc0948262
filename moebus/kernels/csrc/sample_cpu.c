/* One token per row from softmax(x / T) by inversion of its CDF (kernels/sample.py is the spec):
 * with u ~ U[0, 1) drawn by the caller, the token is the first v whose running sum of
 * p_v = exp((x_v - max) / T) exceeds u * sum(p), where tokens below the row's floor (truncation:
 * top-k, top-p, min-p) have p_v = 0. x [B, N] with row stride rs (elements), temp [B] float32,
 * u [B] float64, lo [B] float32 floors or NULL (none), out [B] int64.
 *
 * Why: the torch pipeline wrote a [B, N] float32 copy, its softmax and [B, N] Exp(1) noise for an
 * exponential race (torch's exponential_ is a scalar log per element: ~70 ms of a 64-row step over
 * SmolLM2's 49152-token vocabulary on one core). Here a row is read twice, the second time with one
 * vectorised exp per element, and needs one random number.
 *
 * Per row: pass 1 takes the max in blocks of BLK (and notes the block of the first max, for greedy
 * rows); pass 2 sums exp((x - max) / T) per block into float64 partials; pass 3 walks the partials
 * to the block holding u * total and rescans only that block. A row reads nothing of the other rows,
 * so its token does not depend on the batch. Rows with T <= 0, a NaN, an infinite max or a floor above
 * the max take the row argmax instead (torch's max(dim=1).indices: the first maximum, or the first NaN).
 */
#include <stdlib.h>

#include "cpu_common.h"

#define BLK 256

/* e[i] = exp((x[i] - m) * inv), 0 below the floor, and their float32 sum; the same loop in passes 2
 * and 3, so the rescan sees the values the partial sums were made of. */
INLINE float block_exp(const float *x, int len, float m, float inv, float fl, float *e) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < len; i++) {
        e[i] = x[i] >= fl ? fast_exp((x[i] - m) * inv) : 0.f;
        s += e[i];
    }
    return s;
}

INLINE int64_t sample_row(enum dtype t, int es, const char *row, int64_t n, float temp, double u, float fl,
                          double *part) {
    float buf[BLK], e[BLK];
    float m = -INFINITY;
    int64_t max_blk = 0;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        int nan;
        load_row(t, buf, row + b0 * es, len);
        const float bm = block_max(buf, len, &nan);
        if (nan)
            for (int i = 0; i < len; i++)
                if (buf[i] != buf[i]) return b0 + i;
        if (bm > m) m = bm, max_blk = b0;
    }
    const int argmax = !(temp > 0.f) || m == INFINITY || m == -INFINITY || !(fl <= m);
    const float inv = 1.f / temp;
    const int64_t nb = (n + BLK - 1) / BLK;
    double total = 0.0;
    for (int64_t b = 0; b < nb && !argmax; b++) {
        const int len = n - b * BLK < BLK ? (int)(n - b * BLK) : BLK;
        load_row(t, buf, row + b * BLK * es, len);
        part[b] = block_exp(buf, len, m, inv, fl, e);
        total += part[b];
    }
    if (argmax || !(total > 0.0)) { /* the first maximum (0 if all -inf) */
        const int len = n - max_blk < BLK ? (int)(n - max_blk) : BLK;
        load_row(t, buf, row + max_blk * es, len);
        for (int i = 0; i < len; i++)
            if (buf[i] == m) return max_blk + i;
        return max_blk;
    }
    /* total >= 1 (the max, at or above the floor, contributes exp(0)). The walk adds the partials in
     * the order total did, so it passes target < total unless u * total rounds up to total: then the
     * last block with mass is taken. */
    const double target = u * total;
    double cum = 0.0;
    int64_t hit = -1, last = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (part[b] <= 0.0) continue;
        last = b;
        if (cum + part[b] > target) {
            hit = b;
            break;
        }
        cum += part[b];
    }
    if (hit < 0) hit = last, cum = total - part[last];
    const int len = n - hit * BLK < BLK ? (int)(n - hit * BLK) : BLK;
    load_row(t, buf, row + hit * BLK * es, len);
    block_exp(buf, len, m, inv, fl, e);
    /* Sequential sums may fall short of the vector partial: then the block's last token with mass. */
    int pick = -1;
    for (int i = 0; i < len; i++) {
        if (e[i] <= 0.f) continue;
        pick = i;
        cum += e[i];
        if (cum > target) break;
    }
    return hit * BLK + (pick < 0 ? 0 : pick);
}

/* sum of exp((x_v - m) / T) over x_v >= lo (the normaliser of a truncated softmax; top-p needs it),
 * m the row max given by the caller, in the partial sums sample_row makes. */
INLINE double mass_row(enum dtype t, int es, const char *row, int64_t n, float m, float temp, float fl) {
    float buf[BLK], e[BLK];
    const float inv = 1.f / temp;
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        load_row(t, buf, row + b0 * es, len);
        total += block_exp(buf, len, m, inv, fl, e);
    }
    return total;
}

#define DEFINE_SOFTMAX_MASS(SUFFIX, DT, ES)                                                                   \
    int softmax_mass_##SUFFIX(const void *x, int64_t rs, int64_t rows, int64_t n, const float *m,            \
                              const float *temp, const float *lo, double *out) {                             \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 65536)")                                  \
        for (int64_t r = 0; r < rows; r++)                                                                   \
            out[r] = mass_row(DT, ES, (const char *)x + r * rs * ES, n, m[r], temp[r], lo[r]);               \
        return 0;                                                                                            \
    }

DEFINE_SOFTMAX_MASS(f32, F32, 4)
DEFINE_SOFTMAX_MASS(bf16, BF16, 2)
DEFINE_SOFTMAX_MASS(f16, F16, 2)

/* Returns 0, or 1 when out of memory (the caller falls back to the reference). */
#define DEFINE_SAMPLE_LOGITS(SUFFIX, DT, ES)                                                                  \
    int sample_logits_##SUFFIX(const void *x, int64_t rs, int64_t rows, int64_t n, const float *temp,       \
                               const double *u, const float *lo, int64_t *out) {                             \
        const int64_t nb = (n + BLK - 1) / BLK;                                                              \
        double *part = malloc((size_t)(rows * nb + 1) * sizeof(double));                                    \
        if (!part) return 1;                                                                                 \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 65536)")                                  \
        for (int64_t r = 0; r < rows; r++)                                                                   \
            out[r] = sample_row(DT, ES, (const char *)x + r * rs * ES, n, temp[r], u[r],                     \
                                lo ? lo[r] : -INFINITY, part + r * nb);                                      \
        free(part);                                                                                          \
        return 0;                                                                                            \
    }

DEFINE_SAMPLE_LOGITS(f32, F32, 4)
DEFINE_SAMPLE_LOGITS(bf16, BF16, 2)
DEFINE_SAMPLE_LOGITS(f16, F16, 2)

/* Top-p's floor without a sort (kernels/sample.py top_p_floor_ref is the spec): over the logits at
 * or above kth (top-k's floor, or -inf; one of the row's logits, so the row max survives), with p_v = exp((x_v - max) / T), the largest logit value
 * v such that the mass of {x >= v} reaches top_p * sum(p): the last logit of the shortest prefix by
 * descending logit whose mass reaches top_p (ties with it kept by the sampler's floor).
 *
 * Why: sorting rows of SmolLM2's 49152 logits (topk widened until the prefix fit) made a 64-row
 * step with top_p 0.95 cost 2.7x a greedy one. Here a row is read three times: its max and min; then each p_v is summed into its block partials (the normaliser, as sample_row sums it)
 * and into one of NBUCKET buckets of (max - x) / T spread evenly over [0, min(span, RANGE)] (the rest
 * in a last bucket; WAYS histograms taken in turn, then added); the walk down the buckets finds the one where the mass reaches the target, and
 * only its logits, gathered on a third read, are sorted. */
#define NBUCKET 1024
#define WAYS 4 /* interleaved histograms: a run of logits in one bucket is not one chain of stores */
#define RANGE 30.f /* buckets cover p_v down to exp(-30) of the max's; below, one bucket */

static int desc_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* min(lo, x[0..len)) for a NaN-free block. */
INLINE float block_min(const float *x, int len, float lo) {
#pragma omp simd reduction(min : lo)
    for (int i = 0; i < len; i++) lo = x[i] < lo ? x[i] : lo;
    return lo;
}

/* idx[i]: the bucket of buf[i] (the same float expression on every read of the row). */
INLINE void buckets(const float *buf, int len, float m, float sc, int *idx) {
#pragma omp simd
    for (int i = 0; i < len; i++) {
        const float d = (m - buf[i]) * sc;
        idx[i] = d < (float)(NBUCKET - 1) ? (int)d : NBUCKET - 1; /* NaN-free: x >= kth checked by the caller */
    }
}

/* The floor of one row; hist: WAYS * NBUCKET doubles, cand: n floats of scratch. A row whose max is NaN or
 * infinite, or with no survivor, gives kth (the sampler takes such rows' argmax). */
static float top_p_row(enum dtype t, int es, const char *row, int64_t n, float temp, float top_p, float kth,
                       double *hist, float *cand) {
    float buf[BLK], e[BLK];
    int idx[BLK];
    float m = -INFINITY, lo = INFINITY;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        int nan;
        load_row(t, buf, row + b0 * es, len);
        const float bm = block_max(buf, len, &nan);
        if (nan) return kth;
        m = bm > m ? bm : m;
        lo = block_min(buf, len, lo);
    }
    if (!(top_p < 1.f) || !(temp > 0.f) || m == INFINITY || m == -INFINITY || !(kth <= m)) return kth;
    const float inv = 1.f / temp, span = (m - lo) * inv;
    const float width = (span < RANGE ? span : RANGE) / (float)(NBUCKET - 1);
    const float sc = width > 0.f ? inv / width : 0.f;
    for (int j = 0; j < WAYS * NBUCKET; j++) hist[j] = 0.0;
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        load_row(t, buf, row + b0 * es, len);
        total += block_exp(buf, len, m, inv, kth, e); /* e = 0 below kth: those add nothing below */
        buckets(buf, len, m, sc, idx);
        int i = 0;
        for (; i + WAYS <= len; i += WAYS)
            for (int w = 0; w < WAYS; w++) hist[w * NBUCKET + idx[i + w]] += e[i + w];
        for (; i < len; i++) hist[idx[i]] += e[i];
    }
    for (int w = 1; w < WAYS; w++)
        for (int j = 0; j < NBUCKET; j++) hist[j] += hist[w * NBUCKET + j];
    const double target = (double)top_p * total;
    double cum = 0.0;
    int hit = NBUCKET - 1;
    for (int j = 0; j < NBUCKET; j++) {
        if (cum + hist[j] >= target) {
            hit = j;
            break;
        }
        cum += hist[j];
    }
    int64_t c = 0;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        load_row(t, buf, row + b0 * es, len);
        buckets(buf, len, m, sc, idx);
        for (int i = 0; i < len; i++)
            if (idx[i] == hit && buf[i] >= kth) cand[c++] = buf[i];
    }
    qsort(cand, (size_t)c, sizeof(float), desc_float);
    for (int64_t i = 0; i < c; i++) {
        cum += (double)fast_exp((cand[i] - m) * inv);
        if (cum >= target) return cand[i];
    }
    return c ? cand[c - 1] : kth; /* the sums fell short of the target by rounding: keep the bucket */
}

/* out [B] float32: each row's floor; temp, top_p, kth [B] float32. Returns 0, or 1 when out of
 * memory (the caller falls back to the reference). */
#define DEFINE_TOP_P_FLOOR(SUFFIX, DT, ES)                                                                    \
    int top_p_floor_##SUFFIX(const void *x, int64_t rs, int64_t rows, int64_t n, const float *temp,         \
                             const float *top_p, const float *kth, float *out) {                             \
        int failed = 0;                                                                                      \
        _Pragma("omp parallel if (rows > 1 && rows * n >= 65536) reduction(| : failed)")                     \
        {                                                                                                    \
            double *hist = malloc(WAYS * NBUCKET * sizeof(double));                                                 \
            float *cand = malloc((size_t)n * sizeof(float));                                                 \
            if (!hist || !cand) failed = 1;                                                                  \
            _Pragma("omp for schedule(dynamic, 1)")                                                          \
            for (int64_t r = 0; r < rows; r++)                                                               \
                if (hist && cand)                                                                            \
                    out[r] = top_p_row(DT, ES, (const char *)x + r * rs * ES, n, temp[r], top_p[r], kth[r], \
                                       hist, cand);                                                          \
            free(hist);                                                                                      \
            free(cand);                                                                                      \
        }                                                                                                    \
        return failed;                                                                                       \
    }

DEFINE_TOP_P_FLOOR(f32, F32, 4)
DEFINE_TOP_P_FLOOR(bf16, BF16, 2)
DEFINE_TOP_P_FLOOR(f16, F16, 2)
