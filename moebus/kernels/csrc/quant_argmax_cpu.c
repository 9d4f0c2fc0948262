/* Greedy tokens from a GGUF-block LM head: out[m] = argmax_n logits[m][n] without writing the
 * [M, N] logits, where logits are exactly what the few-row GEMVs give (quant_dot_cpu.c on `bits`
 * = 8 / 16-bit integer activations, or quant_matmul_cpu.c's direct path on float ones, bits = 0):
 * the same inline row loops (quant_dot.h, quant_direct.h) fill a chunk of logits in a thread's
 * small buffer, reduced there to the chunk's best; the chunks' bests are reduced in chunk order.
 * torch's max(dim=1).indices semantics: the first maximum, or the first NaN of a row holding one
 * (kernels/quant_argmax.py). Which thread ran a chunk never changes the result.
 *
 * Why: at batch 1 the tied head of SmolLM2 (49152 x 576 Q8_0) is the largest GEMV of a decode
 * step; writing its logits and reading them back for a separate argmax call cost ~0.1 ms a token
 * (plus a call and an OpenMP region). Chunks are claimed dynamically, so a descheduled thread on
 * a loaded box holds back one chunk, not half the vocabulary.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_direct.h"
#include "quant_dot.h"

#define CH 256 /* vocabulary rows a chunk (Q8_0, K 576: 153 KB of weight) */

struct best {
    float v;       /* the row's maximum so far (-inf: none yet) */
    int64_t i;     /* its first index (INT64_MAX: none yet) */
    int64_t nan_i; /* the first NaN's index (INT64_MAX: none) */
};

/* The best of one chunk's logits o[0..len) (vocabulary rows n0 + i). */
static struct best chunk_best(const float *o, int len, int64_t n0) {
    struct best b = {-INFINITY, INT64_MAX, INT64_MAX};
    int nan;
    const float m = block_max(o, len, &nan);
    for (int i = 0; nan && i < len; i++)
        if (o[i] != o[i]) {
            b.nan_i = n0 + i;
            break;
        }
    for (int i = 0; m > b.v && i < len; i++) /* m = -inf: none (an all -inf row gives 0 below) */
        if (o[i] == m) b.v = m, b.i = n0 + i;
    return b;
}

/* out [M] int64; x [M, K] (row stride xs), w [N, K / 32 blocks] (row stride ws bytes). Returns 0;
 * 1 for an unknown type or width, K not a multiple of 32, M outside [1, 64] or no memory. */
int quant_argmax_f32(int bits, int qt, const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t M,
                     int64_t N, int64_t K, int64_t *out) {
    if (!known_qtype(qt) || bad_k(K) || (bits != 0 && bits != 8 && bits != 16) || M < 1 || M > 64) return 1;
    if (N <= 0) {
        for (int64_t m = 0; m < M; m++) out[m] = 0;
        return 0;
    }
    const int nb = (int)(K / QK), nt_max = omp_get_max_threads();
    const int64_t qbytes = bits ? M * K * (bits / 8) : 0, nchunks = (N + CH - 1) / CH;
    /* the quantized rows (or, float activations, the block sums), then per thread a chunk's logits */
    char *mem = malloc((size_t)qbytes + 2 * (size_t)(M * nb) * sizeof(float) + (size_t)nt_max * M * CH * sizeof(float));
    struct best *all = malloc((size_t)nchunks * M * sizeof(struct best)); /* [chunk][row] */
    if (!mem || !all) {
        free(mem), free(all);
        return 1;
    }
    float *dd = (float *)(mem + qbytes), *bufs = dd + 2 * M * nb; /* qbytes: a multiple of 32 */
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * xs;
        if (bits == 16) quantize_row(1, nibble_order(qt, 1), xm, nb, (int16_t *)mem + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
        else if (bits == 8) quantize_row(0, 0, xm, nb, (int8_t *)mem + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
        else
            for (int b = 0; b < nb; b++) { /* quant_matmul_cpu.c's block sums, in its order */
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += xm[b * QK + j];
                dd[m * nb + b] = s;
            }
    }
#pragma omp parallel if (M * N * K >= 262144)
    {
        float *buf = bufs + (int64_t)omp_get_thread_num() * M * CH;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < nchunks; c++) {
            const int64_t n0 = c * CH, len = N - n0 < CH ? N - n0 : CH;
            const uint8_t *wc = w + n0 * ws;
            if (bits) { /* type and width compile-time constants in each instance */
#define QA_TYPES(WIDE)                                                                   \
    switch (qt) {                                                                        \
    case Q4_0: qa_path(Q4_0, WIDE, mem, dd, nb, wc, ws, M, 0, len, buf, CH); break;      \
    case Q4_1: qa_path(Q4_1, WIDE, mem, dd, nb, wc, ws, M, 0, len, buf, CH); break;      \
    default: qa_path(Q8_0, WIDE, mem, dd, nb, wc, ws, M, 0, len, buf, CH);               \
    }
                if (bits == 16) QA_TYPES(1) else QA_TYPES(0)
#undef QA_TYPES
            } else {
                switch (qt) {
                case Q4_0: direct_path(Q4_0, x, xs, dd, nb, wc, ws, M, 0, len, buf, CH); break;
                case Q4_1: direct_path(Q4_1, x, xs, dd, nb, wc, ws, M, 0, len, buf, CH); break;
                default: direct_path(Q8_0, x, xs, dd, nb, wc, ws, M, 0, len, buf, CH);
                }
            }
            for (int64_t m = 0; m < M; m++) all[c * M + m] = chunk_best(buf + m * CH, (int)len, n0);
        }
    }
    for (int64_t m = 0; m < M; m++) { /* chunks in order: a tie keeps the earlier, whichever thread ran them */
        struct best b = all[m];
        for (int64_t c = 1; c < nchunks; c++) {
            const struct best o = all[c * M + m];
            if (o.v > b.v) b.v = o.v, b.i = o.i;
            if (o.nan_i < b.nan_i) b.nan_i = o.nan_i;
        }
        out[m] = b.nan_i != INT64_MAX ? b.nan_i : b.i != INT64_MAX ? b.i : 0; /* all -inf: the first */
    }
    free(mem), free(all);
    return 0;
}
