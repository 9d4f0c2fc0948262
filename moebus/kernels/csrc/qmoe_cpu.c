/* Fused MoE MLP on GGUF-quantized experts (Q4_0 / Q4_1 / Q8_0) in qpanel.h's panels, float32
 * activations: kernels/qmoe.py's qmoe_ref is the spec.
 *
 * x [T, D] (row stride xs), p13 / p2: each expert's [2I, D] / [D, I] weight as qpanel_pack lays it
 * out, experts back to back, p13 of type qt and p2 of qt2 (a Q4_K_M file's down experts are Q6_K,
 * served as Q8_0, beside Q4_K gate/up served as Q4_1); topk_weights [T, k] float32, topk_ids [T, k] int64, out [T, D].
 * The T*k assignments are grouped by expert (stable) and their rows gathered, so each active expert
 * is two GEMMs over all of its tokens: every panel of an active expert is read once a step, a Q8_0
 * weight costs ~1.06 bytes and a Q4 one ~0.56 (bf16: 2). Rows are quantized to int16 blocks as
 * qpanel.h's linear layer quantizes them, gate|up -> SwiGLU in float32 -> quantized again -> down,
 * then the k-slot combine in float32 in slot order. qpanel.h's one formula a (row, output) and the
 * fixed combine order make each token's result the same bits whatever else is in the batch.
 * Returns 1 for an unknown type or D, I not multiples of 32, 2 for an expert id outside [0, E),
 * 3 when out of memory: the caller falls back.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"
#include "qpanel.h"

#define GROUP 4 /* panels (64 outputs) a task: 16 tasks an expert's gate|up at I = 512 */

/* rows [A, K] float32 -> int16 q [A, K] then (d, d sum q) pairs [A, nb] at dd, as qpanel_cpu.c. */
static void quantize_rows(const float *x, int64_t K, int A, int16_t *q, float *dd) {
    const int nb = (int)(K / QK);
#pragma omp for schedule(static)
    for (int r = 0; r < A; r++) quantize_row(1, 0, x + (int64_t)r * K, nb, q + (int64_t)r * K, dd + 2 * (int64_t)r * nb,
                                             dd + 2 * (int64_t)r * nb + 1, 2);
}

/* Every active expert's rows (grouped: expert e's at [start[e], start[e + 1])) by its panels into
 * out [A, N]: (expert, group of panels) tasks over the team, in guided chunks: a thread's next task
 * is mostly the next group of the same expert, whose panels follow in memory (Granite-shaped Q8_0
 * steps in process: batch 16 80 -> 74 ms, 64 195 -> 186, against schedule(dynamic, 1)). */
static void all_experts(int qt, const int16_t *q, const float *dd, int64_t K, const uint8_t *pans, int64_t stride,
                        int64_t N, const int *start, const int *active, int n_active, float *out) {
    const int nb = (int)(K / QK);
    const int64_t P = (N + QP_W - 1) / QP_W, groups = (P + GROUP - 1) / GROUP;
#pragma omp for schedule(guided)
    for (int64_t task = 0; task < (int64_t)n_active * groups; task++) {
        const int e = active[task / groups], s = start[e], n = start[e + 1] - s;
        const int64_t n0 = task % groups * GROUP * QP_W, n1e = n0 + GROUP * QP_W, n1 = n1e < N ? n1e : N;
        const uint8_t *w = pans + e * stride;
        const int16_t *xq = q + (int64_t)s * K;
        const float *xd = dd + 2 * (int64_t)s * nb;
        switch (qt) { /* the type a compile-time constant in each instance */
        case Q4_0: qp_path(Q4_0, w, nb, xq, xd, n, n0, n1, out + (int64_t)s * N, N); break;
        case Q4_1: qp_path(Q4_1, w, nb, xq, xd, n, n0, n1, out + (int64_t)s * N, N); break;
        default: qp_path(Q8_0, w, nb, xq, xd, n, n0, n1, out + (int64_t)s * N, N);
        }
    }
}

int qmoe_f32(int qt, int qt2, const float *x, int64_t xs, const uint8_t *p13, const uint8_t *p2, const float *tw,
             const int64_t *ids, float *out, int T, int k, int E, int D, int I, int has_limit, float limit) {
    if (!known_qtype(qt) || !known_qtype(qt2) || bad_k(D) || bad_k(I) || T <= 0 || k <= 0 || E <= 0) return 1;
    const int A = T * k, nbd = D / QK, nbi = I / QK;
    int *start = calloc((size_t)E + 1, sizeof(int)), *fill = malloc(((size_t)E + 1) * sizeof(int));
    int *order = malloc((size_t)A * sizeof(int)), *slot = malloc((size_t)A * sizeof(int));
    int *active = malloc(((size_t)E + 1) * sizeof(int));
    float *xg = malloc((size_t)A * D * sizeof(float)), *h = malloc((size_t)A * 2 * I * sizeof(float));
    float *act = malloc((size_t)A * I * sizeof(float)), *y = malloc((size_t)A * D * sizeof(float));
    /* int16 rows then their (d, d sum q) pairs; D, I multiples of 32 keep the pairs 4-byte aligned */
    int16_t *qx = malloc((size_t)A * D * 2 + (size_t)A * nbd * 2 * sizeof(float));
    int16_t *qa = malloc((size_t)A * I * 2 + (size_t)A * nbi * 2 * sizeof(float));
    int status = 0, n_active = 0;
    if (!(start && fill && order && slot && active && xg && h && act && y && qx && qa)) status = 3;
    for (int a = 0; !status && a < A; a++) {
        if (ids[a] < 0 || ids[a] >= E) status = 2;
        else start[ids[a] + 1]++;
    }
    if (!status) {
        for (int e = 0; e < E; e++) {
            if (start[e + 1]) active[n_active++] = e;
            start[e + 1] += start[e];
        }
        memcpy(fill, start, (size_t)E * sizeof(int));
        for (int a = 0; a < A; a++) slot[a] = fill[ids[a]]++; /* grouped by expert, stable */
        for (int a = 0; a < A; a++) order[slot[a]] = a;
        float *dx = (float *)(qx + (int64_t)A * D), *da = (float *)(qa + (int64_t)A * I);
        const int64_t s13 = (int64_t)(2 * I + QP_W - 1) / QP_W * nbd * qp_block_bytes(qt);
        const int64_t s2 = (int64_t)(D + QP_W - 1) / QP_W * nbi * qp_block_bytes(qt2);
#pragma omp parallel if (A >= 2 || (int64_t)D * I >= 65536)
        {
#pragma omp for schedule(static)
            for (int r = 0; r < A; r++) memcpy(xg + (int64_t)r * D, x + (int64_t)(order[r] / k) * xs, (size_t)D * 4);
            quantize_rows(xg, D, A, qx, dx);
            all_experts(qt, qx, dx, D, p13, s13, 2 * I, start, active, n_active, h);
#pragma omp for schedule(static)
            for (int r = 0; r < A; r++) { /* act = silu(min(gate, limit)) * clamp(up, -limit, limit) */
                const float *g = h + (int64_t)r * 2 * I, *u = g + I;
                float *o = act + (int64_t)r * I;
#pragma omp simd
                for (int i = 0; i < I; i++) {
                    const float gi = has_limit ? min_hi(g[i], limit) : g[i];
                    const float ui = has_limit ? clamp_lo_hi(u[i], -limit, limit) : u[i];
                    o[i] = gi / (1.f + fast_exp(-gi)) * ui;
                }
            }
            quantize_rows(act, I, A, qa, da);
            all_experts(qt2, qa, da, I, p2, s2, D, start, active, n_active, y);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) { /* out[t] = sum_j w[t, j] y[t, j], in float32, j in order */
                float *o = out + (int64_t)t * D;
                memset(o, 0, (size_t)D * sizeof(float));
                for (int j = 0; j < k; j++) {
                    const float w = tw[t * k + j], *yr = y + (int64_t)slot[t * k + j] * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) o[d] += w * yr[d];
                }
            }
        }
    }
    free(start), free(fill), free(order), free(slot), free(active), free(xg), free(h), free(act), free(y);
    free(qx), free(qa);
    return status;
}
