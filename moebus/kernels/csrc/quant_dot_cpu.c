/* GGUF-block linear layers on integer activations: out[m][n] = qa(x_m) . dequant(w_n), integer dot
 * products per 32-weight block. The semantics of kernels/quant_matmul.py's quant_matmul_qa_ref.
 *
 * Why: decoding every weight block to float32 (quant_matmul_cpu.c's direct path) costs ~4 ns a
 * block on one Zen 3 core, most of a batch-1 decode step. Quantizing the activation row once per
 * call to integer blocks lets each weight block be a few integer multiply-adds into int32 lanes and
 * one float multiply-add. Two activation widths:
 *   8 bits  (as llama.cpp's Q8 activations): AVX2 maddubs + madd, or one VNNI dpbusd, a block;
 *   16 bits: two madd_epi16 a block, the weight widened to int16; ~256x less rounding error.
 *
 * Activation block (32 floats x), QMAX = 127 or 32767: amax = max |x|, d = amax / QMAX,
 * q = rint(x * (1 / d)) (nearest even; q = 0 when d = 0), kept as q, float d, and d * sum(q) (for the
 * weight's offset term). Per weight block (scale dw; Q4_1 min mw; nibbles u in 0..15, Q8_0 int8 v):
 *   Q4_0: (dw * d) * sum(u q) + (-8 dw) * (d * sum(q))
 *   Q4_1: (dw * d) * sum(u q) + mw * (d * sum(q))
 *   Q8_0: (dw * d) * sum(v q)
 * summed over blocks in float32. Weight layouts as quant_matmul_cpu.c. Rows of x are independent:
 * a row's result is the same whatever the row count of the call.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_dot.h"

/* The activation quantization alone (tests compare it with the torch reference bit for bit):
 * x [M, K] (row stride xs) -> q [M, K] (int8, int16 when bits == 16), d and d * sum(q) [M, K / 32].
 * Returns 1 when K % 32 != 0 or bits is not 8 or 16. */
int quantize_act_f32(int bits, const float *x, int64_t xs, int64_t M, int64_t K, void *q, float *d, float *ds) {
    if (bad_k(K) || (bits != 8 && bits != 16)) return 1;
    const int nb = (int)(K / QK);
    for (int64_t m = 0; m < M; m++) {
        if (bits == 16) quantize_row(1, 0, x + m * xs, nb, (int16_t *)q + m * K, d + m * nb, ds + m * nb, 1);
        else quantize_row(0, 0, x + m * xs, nb, (int8_t *)q + m * K, d + m * nb, ds + m * nb, 1);
    }
    return 0;
}

/* out [M, N] (row stride os) = qa(x) . dequant(w), activations of `bits` (8 or 16). Returns 0 on
 * success; 1 for an unknown type or width, K not a multiple of 32 or no memory. */
int quant_matmul_qa_f32(int bits, int qt, const float *x, int64_t xs, const uint8_t *w, int64_t ws, int64_t M,
                        int64_t N, int64_t K, float *out, int64_t os) {
    if (!known_qtype(qt) || bad_k(K) || (bits != 8 && bits != 16)) return 1;
    if (M <= 0 || N <= 0) return 0;
    const int nb = (int)(K / QK);
    const int64_t qbytes = M * K * (bits / 8);
    char *q = malloc((size_t)qbytes + 2 * (size_t)(M * nb) * sizeof(float));
    if (!q) return 1;
    float *dd = (float *)(q + qbytes); /* qbytes: a multiple of 32 */
    for (int64_t m = 0; m < M; m++) {
        if (bits == 16) quantize_row(1, nibble_order(qt, 1), x + m * xs, nb, (int16_t *)q + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
        else quantize_row(0, 0, x + m * xs, nb, (int8_t *)q + m * K, dd + 2 * m * nb, dd + 2 * m * nb + 1, 2);
    }
#pragma omp parallel if (M * N * K >= 262144)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t units = (N + 7) / 8; /* contiguous ranges of 8-row multiples: each thread its own part of w */
        int64_t n0 = units * tid / nt * 8, n1 = units * (tid + 1) / nt * 8;
        n1 = n1 < N ? n1 : N;
        if (n0 < n1) { /* type and width compile-time constants in each instance */
#define QA_TYPES(WIDE)                                                                   \
    switch (qt) {                                                                        \
    case Q4_0: qa_path(Q4_0, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os); break;      \
    case Q4_1: qa_path(Q4_1, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os); break;      \
    default: qa_path(Q8_0, WIDE, q, dd, nb, w, ws, M, n0, n1, out, os);               \
    }
            if (bits == 16) QA_TYPES(1) else QA_TYPES(0)
#undef QA_TYPES
        }
    }
    free(q);
    return 0;
}
