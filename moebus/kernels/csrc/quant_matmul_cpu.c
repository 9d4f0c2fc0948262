/* Linear layers on GGUF weight-only quantized weights: out[m][n] = x_m . dequant(w_n), the
 * semantics of kernels/quant_matmul.py's reference, with the weight dequantized inside the kernel.
 *
 * w is N rows of K / 32 GGUF blocks each (row stride ws bytes), ggml's layouts:
 *   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
 *   Q8_0 (34 bytes): f16 d, 32 int8; w = d * q
 * Byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).
 * x is float32 [M, K] (row stride xs elements), out float32 [M, N] (row stride os).
 *
 * Two paths. Few rows (decode): each block is decoded once into four 8-float vectors and
 * multiplied into every x row in registers, summing d * sum(q x) + m * sum(x) per block with the
 * block sums of x taken once per call: the weight streams from memory once, at 4.5-5 bits a
 * weight instead of 32, which is what bounds a decode step. Many rows (prefill, batches): panels of
 * 16 weight rows are dequantized into a float32 buffer that stays in L2, and cpu_dot.h's register
 * tiles run every x row over it, so the decode is amortised over the rows. Both paths compute each
 * row of x independently of the others in the call; the direct path is also taken for every row
 * count when the caller asks for one path (deterministic mode), since the two sum differently.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_direct.h"

#define PANEL 16 /* weight rows dequantized together on the tiled path */

/* Tiled path: panels [p0, p1) of PANEL weight rows, dequantized into buf, against every x row. */
static void tiled_path(int qt, const float *const *xrows, int nb, const uint8_t *w, int64_t ws, int64_t M,
                       int64_t N, int64_t p0, int64_t p1, float *buf, float **dst, float *out, int64_t os) {
    const int K = nb * QK, bb = block_bytes(qt);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * PANEL;
        const int nr = N - n0 < PANEL ? (int)(N - n0) : PANEL;
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < nb; b++) dequant_block(qt, w + (n0 + r) * ws + (int64_t)b * bb, buf + (int64_t)r * K + b * QK);
        for (int64_t m = 0; m < M; m++) dst[m] = out + m * os + n0;
        dots_rows(F32, 4, (const char *)buf, (int64_t)K * 4, nr, xrows, (int)M, K, (float *const *)dst);
    }
}

/* Returns 0 on success; 1 for an unknown type, K not a multiple of 32 or no memory (the caller
 * falls back to the reference). min_tiled_rows: the fewest rows that take the tiled path
 * (INT_MAX: always the direct path). */
int quant_matmul_f32(int qt, const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t M, int64_t N,
                     int64_t K, float *out, int64_t os, int min_tiled_rows) {
    if (!known_qtype(qt) || bad_k(K)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    const int64_t work = M * N * K;
    if (M < min_tiled_rows) {
        float *xsum = malloc((size_t)M * nb * sizeof(float) + 1);
        if (!xsum) return 1;
        for (int64_t m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += x[m * xs + b * QK + j];
                xsum[m * nb + b] = s;
            }
#pragma omp parallel if (work >= 262144)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            /* Contiguous ranges in multiples of 8 rows: each thread streams its own part of w. */
            const int64_t units = (N + 7) / 8;
            int64_t n0 = units * tid / nt * 8, n1 = units * (tid + 1) / nt * 8;
            n1 = n1 < N ? n1 : N;
            if (n0 < n1) {
                switch (qt) {
                case Q4_0: direct_path(Q4_0, x, xs, xsum, nb, w, ws, M, n0, n1, out, os); break;
                case Q4_1: direct_path(Q4_1, x, xs, xsum, nb, w, ws, M, n0, n1, out, os); break;
                default: direct_path(Q8_0, x, xs, xsum, nb, w, ws, M, n0, n1, out, os);
                }
            }
        }
        free(xsum);
        return 0;
    }
    const int nt_max = omp_get_max_threads();
    float *bufs = malloc((size_t)nt_max * PANEL * K * sizeof(float));
    float **dsts = malloc((size_t)nt_max * M * sizeof(float *));
    const float **xrows = malloc((size_t)M * sizeof(float *));
    if (!bufs || !dsts || !xrows) {
        free(bufs), free(dsts), free(xrows);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) xrows[m] = x + m * xs;
    const int64_t P = (N + PANEL - 1) / PANEL;
#pragma omp parallel if (work >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = P * tid / nt, p1 = P * (tid + 1) / nt;
        float *buf = bufs + (int64_t)tid * PANEL * K;
        float **dst = dsts + (int64_t)tid * M;
        switch (qt) {
        case Q4_0: tiled_path(Q4_0, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os); break;
        case Q4_1: tiled_path(Q4_1, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os); break;
        default: tiled_path(Q8_0, (const float *const *)xrows, nb, w, ws, M, N, p0, p1, buf, dst, out, os);
        }
    }
    free(bufs), free(dsts), free(xrows);
    return 0;
}
