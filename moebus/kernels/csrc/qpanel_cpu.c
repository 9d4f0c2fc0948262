/* Linear layers on GGUF weights in 16-output panels and 16-bit integer activations (qpanel.h: the
 * layout and the one formula every row count takes). */
#include <omp.h>
#include <stdlib.h>

#include "qpanel.h"

/* 1 where the panels run on AVX-512 (else the plain C tile: right, but slow). */
int qpanel_simd(void) { return MOEBUS_QP512; }

/* GGUF rows w [N, K / 32 blocks] (row stride ws bytes) -> panels at dst (qpanel.py's panel_bytes). Returns 1 for
 * an unknown type or K not a multiple of 32. */
int qpanel_pack(int qt, const uint8_t *w, int64_t ws, int64_t N, int64_t K, uint8_t *dst) {
    if (!known_qtype(qt) || bad_k(K) || N <= 0) return 1;
    const int nb = (int)(K / QK), bb = qp_block_bytes(qt), gb = block_bytes(qt);
    const int64_t P = (N + QP_W - 1) / QP_W;
#pragma omp parallel for
    for (int64_t p = 0; p < P; p++) {
        const int nr = N - p * QP_W < QP_W ? (int)(N - p * QP_W) : QP_W;
        const uint8_t *rows[QP_W];
        for (int b = 0; b < nb; b++) {
            for (int o = 0; o < nr; o++) rows[o] = w + (p * QP_W + o) * ws + (int64_t)b * gb;
            qp_pack_block(qt, rows, nr, dst + (p * nb + b) * bb);
        }
    }
    return 0;
}

/* x [M, K] (row stride xs, K % 32 == 0) quantized as quant_dot.h's quantize_row: M K int16, then at
 * q + M K the (d, d sum q) pairs of every block (M K int16 is a multiple of 64 bytes). NULL: no
 * memory; the caller frees it. */
static int16_t *quantized(const float *x, int64_t xs, int64_t M, int64_t K) {
    const int nb = (int)(K / QK);
    int16_t *q = aligned_alloc(64, ((size_t)(M * K * 2 + 2 * M * nb * sizeof(float)) + 63) / 64 * 64);
    if (!q) return NULL;
    float *dd = (float *)(q + M * K);
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(1, 0, x + m * xs, nb, q + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
    return q;
}

/* out [M, N] (row stride os) = x [M, K] (row stride xs) on the panels. Returns 1 for an unknown type,
 * K not a multiple of 32 or no memory. */
int qpanel_matmul_f32(int qt, const float *x, int64_t xs, const uint8_t *pans, int64_t M, int64_t N, int64_t K,
                      float *out, int64_t os) {
    if (!known_qtype(qt) || bad_k(K)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    int16_t *q = quantized(x, xs, M, K);
    if (!q) return 1;
    const float *dd = (const float *)(q + M * K);
    const int64_t P = (N + QP_W - 1) / QP_W;
#pragma omp parallel if (M * N * K >= 262144)
    {
        /* contiguous panel ranges: each thread streams its own part of the weight */
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = P * tid / nt * QP_W, n1e = P * (tid + 1) / nt * QP_W;
        const int64_t n1 = n1e < N ? n1e : N;
        if (n0 < n1) {
            switch (qt) {
            case Q4_0: qp_path(Q4_0, pans, nb, q, dd, M, n0, n1, out, os); break;
            case Q4_1: qp_path(Q4_1, pans, nb, q, dd, M, n0, n1, out, os); break;
            default: qp_path(Q8_0, pans, nb, q, dd, M, n0, n1, out, os);
            }
        }
    }
    free(q);
    return 0;
}

/* The plain C tile on the same inputs (tests: the SIMD tile must give its bits). */
int qpanel_matmul_plain_f32(int qt, const float *x, int64_t xs, const uint8_t *pans, int64_t M, int64_t N,
                            int64_t K, float *out, int64_t os) {
    if (!known_qtype(qt) || bad_k(K)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    int16_t *q = quantized(x, xs, M, K);
    if (!q) return 1;
    const float *dd = (const float *)(q + M * K);
    const int64_t ps = (int64_t)nb * qp_block_bytes(qt);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n += QP_W)
            qp_tile_c(qt, pans + n / QP_W * ps, nb, q + m * K, dd + 2 * m * nb, K, 1, out + m * os + n, os,
                      N - n < QP_W ? (int)(N - n) : QP_W);
    free(q);
    return 0;
}
