/* Fused MoE MLP on packed expert panels: kernels/fused_moe.py's fused_moe_ref is the spec.
 * x [T, D] (row stride xs), w13p / w2p each expert's [2I, D] / [D, I] weight packed by pack_panels
 * (bf16: [N / 16][K / 2][16][2] for vdpbf16ps; float32: [N / 16][K][16]), experts back to back,
 * topk_weights [T, k] float32, topk_ids [T, k] int64, out [T, D].
 *
 * The T*k assignments are grouped by expert and their rows gathered, so each expert is two GEMMs
 * (gate|up, then down) over all of its tokens in the panel kernel's register tiles (panel_tiles.h):
 * every weight panel is read from memory once a step and feeds up to 12 rows, instead of once per
 * token as in fused_moe_cpu.c's per-token dots. Threads take (expert, group of panels) tasks.
 * GEMM outputs are rounded to the storage type and SwiGLU is computed in float32 then rounded, as
 * the reference's unfused ops do; the k-slot combine sums in float32. Each row's sums run in a
 * fixed order whatever else is in the batch (batch invariant). Returns 1 for shapes outside the
 * panel kernel (2I, D not multiples of 16; bf16 D, I not of 32) or a build without the ISA, 2 for
 * an expert id outside [0, E), 3 when out of memory: the caller falls back.
 */
#include <stdlib.h>

#include "cpu_common.h"
#include "panel_tiles.h"

#if defined(__AVX512F__)
#define CHUNK 1024 /* elements of a row converted to float32 at a time (stack buffers) */

/* rows [s, s + n) of a [*, K] matrix at a (row stride K) times panels [p0, p1) of one expert's
 * packed weight wp -> out rows (row stride N), in row blocks of ROWS */
#define DEFINE_EXPERT_GEMM(T, ES, STEP_K)                                                                     \
    static void expert_gemm_##T(const char *a, int K, const char *wp, int N, int s, int n, int64_t p0,        \
                                int64_t p1, char *out) {                                                      \
        const int steps = K / STEP_K;                                                                         \
        const int64_t pstride = (int64_t)steps * 64, P = N / NR, q1 = p1 + GROUP < P ? p1 + GROUP : P;         \
        for (int m0 = 0; m0 < n; m0 += ROWS) {                                                                \
            const int rows = n - m0 < ROWS ? n - m0 : ROWS;                                                   \
            int64_t nb;                                                                                       \
            const int64_t o = pf_slice((q1 - p1) * pstride, m0, rows, n, &nb);                               \
            const char *pf = nb > 0 ? wp + p1 * pstride + o : 0;                                              \
            panels_rows_##T(a + (int64_t)(s + m0) * K * ES, (int64_t)K * ES, wp, pstride, steps, 0,            \
                            out + (int64_t)(s + m0) * N * ES, (int64_t)N * ES, rows, p0, p1, pf, nb);         \
        }                                                                                                     \
    }

/* Every active expert's GEMM of `rows` [A, K] by its packed weight (experts `stride` bytes apart)
 * into out [A, N]: (expert, group of panels) tasks over the team, in guided chunks (runs of
 * consecutive tasks), so the thread that prefetched the next group's panels is the one that takes
 * it, as in panel_linear_cpu.c. With schedule(dynamic, 1) the other thread mostly did: a
 * Granite-shaped bf16 step (8 of 32 experts) took 1.3-1.8x as long at batch 1, 16 and 64. */
#define DEFINE_ALL_EXPERTS(T, ES, STEP_K)                                                                     \
    static void all_experts_##T(const char *rows, int K, const char *wp, int64_t stride, int N,               \
                                const int *start, const int *active, int n_active, char *out) {              \
        const int64_t groups = (N / NR + GROUP - 1) / GROUP;                                                  \
        _Pragma("omp for schedule(guided)")                                                                   \
        for (int64_t task = 0; task < (int64_t)n_active * groups; task++) {                                   \
            const int e = active[task / groups];                                                              \
            const int64_t p0 = task % groups * GROUP, p1 = p0 + GROUP < N / NR ? p0 + GROUP : N / NR;         \
            expert_gemm_##T(rows, K, wp + e * stride, N, start[e], start[e + 1] - start[e], p0, p1, out);    \
        }                                                                                                     \
    }

DEFINE_PANELS_ROWS(f32, 4)
DEFINE_EXPERT_GEMM(f32, 4, 1)
DEFINE_ALL_EXPERTS(f32, 4, 1)
#if defined(__AVX512BF16__)
DEFINE_PANELS_ROWS(bf16, 2)
DEFINE_EXPERT_GEMM(bf16, 2, 2)
DEFINE_ALL_EXPERTS(bf16, 2, 2)
#define HAVE_BF16_PANELS 1
#endif

#define DEFINE_MOE_PANELS(T, DT, ES, STEP_K)                                                                  \
    int fused_moe_panels_##T(const void *x, int64_t xs, const void *w13p, const void *w2p, const float *tw,    \
                             const int64_t *ids, void *out, int T_, int k, int E, int D, int I, int has_limit, \
                             float limit) {                                                                   \
        if ((2 * I) % NR || D % NR || (STEP_K == 2 && (D % 32 || I % 32)) || T_ <= 0) return 1;                \
        const int A = T_ * k;                                                                                 \
        int *start = calloc((size_t)E + 1, sizeof(int)), *fill = malloc(((size_t)E + 1) * sizeof(int));      \
        int *order = malloc((size_t)A * sizeof(int)), *active = malloc(((size_t)E + 1) * sizeof(int));        \
        char *xg = malloc((size_t)A * D * ES), *h = malloc((size_t)A * 2 * I * ES);                           \
        char *act = malloc((size_t)A * I * ES), *y = malloc((size_t)A * D * ES);                              \
        int *slot = malloc((size_t)A * sizeof(int)), status = 0, n_active = 0;                                \
        if (!(start && fill && order && active && xg && h && act && y && slot)) status = 3;                   \
        for (int a = 0; !status && a < A; a++) {                                                              \
            if (ids[a] < 0 || ids[a] >= E) status = 2;                                                        \
            else start[ids[a] + 1]++;                                                                         \
        }                                                                                                     \
        if (!status) {                                                                                        \
            for (int e = 0; e < E; e++) {                                                                     \
                if (start[e + 1]) active[n_active++] = e;                                                     \
                start[e + 1] += start[e];                                                                     \
            }                                                                                                 \
            memcpy(fill, start, (size_t)E * sizeof(int));                                                     \
            for (int a = 0; a < A; a++) slot[a] = fill[ids[a]]++; /* grouped by expert, stable */            \
            for (int a = 0; a < A; a++) order[slot[a]] = a;                                                   \
            const int64_t s13 = (int64_t)2 * I * D * ES, s2 = (int64_t)D * I * ES;                            \
            _Pragma("omp parallel")                                                                           \
            {                                                                                                 \
                _Pragma("omp for schedule(static)")                                                           \
                for (int r = 0; r < A; r++)                                                                   \
                    memcpy(xg + (int64_t)r * D * ES, (const char *)x + (int64_t)(order[r] / k) * xs * ES,       \
                           (size_t)D * ES);                                                                   \
                all_experts_##T(xg, D, (const char *)w13p, s13, 2 * I, start, active, n_active, h);           \
                _Pragma("omp for schedule(static)")                                                           \
                for (int r = 0; r < A; r++) /* act = silu(min(gate, limit)) * clamp(up, -limit, limit) */   \
                    for (int i0 = 0; i0 < I; i0 += CHUNK) {                                                   \
                        const int n = I - i0 < CHUNK ? I - i0 : CHUNK;                                        \
                        float g[CHUNK], u[CHUNK];                                                             \
                        load_row(DT, g, h + ((int64_t)r * 2 * I + i0) * ES, n);                               \
                        load_row(DT, u, h + ((int64_t)r * 2 * I + I + i0) * ES, n);                           \
                        _Pragma("omp simd")                                                                   \
                        for (int i = 0; i < n; i++) {                                                         \
                            const float gi = has_limit ? min_hi(g[i], limit) : g[i];                          \
                            const float ui = has_limit ? clamp_lo_hi(u[i], -limit, limit) : u[i];             \
                            g[i] = gi / (1.f + fast_exp(-gi)) * ui;                                           \
                        }                                                                                     \
                        store_row(DT, act + ((int64_t)r * I + i0) * ES, g, 1.f, n);                           \
                    }                                                                                         \
                all_experts_##T(act, I, (const char *)w2p, s2, D, start, active, n_active, y);                \
                _Pragma("omp for schedule(static)")                                                           \
                for (int tok = 0; tok < T_; tok++) /* out[t] = sum_j w[t, j] y[t, j], in float32 */          \
                    for (int d0 = 0; d0 < D; d0 += CHUNK) {                                                   \
                        const int n = D - d0 < CHUNK ? D - d0 : CHUNK;                                        \
                        float acc[CHUNK], yr[CHUNK];                                                          \
                        memset(acc, 0, (size_t)n * sizeof(float));                                            \
                        for (int j = 0; j < k; j++) {                                                         \
                            const float w = tw[tok * k + j];                                                  \
                            load_row(DT, yr, y + ((int64_t)slot[tok * k + j] * D + d0) * ES, n);              \
                            _Pragma("omp simd")                                                               \
                            for (int d = 0; d < n; d++) acc[d] += w * yr[d];                                  \
                        }                                                                                     \
                        store_row(DT, (char *)out + ((int64_t)tok * D + d0) * ES, acc, 1.f, n);               \
                    }                                                                                         \
            }                                                                                                 \
        }                                                                                                     \
        free(start), free(fill), free(order), free(active), free(xg), free(h), free(act), free(y), free(slot); \
        return status;                                                                                        \
    }

DEFINE_MOE_PANELS(f32, F32, 4, 1)
#if defined(HAVE_BF16_PANELS)
DEFINE_MOE_PANELS(bf16, BF16, 2, 2)
#endif
#endif

#define DECLINE(T)                                                                                            \
    int fused_moe_panels_##T(const void *x, int64_t xs, const void *w13p, const void *w2p, const float *tw,    \
                             const int64_t *ids, void *out, int T_, int k, int E, int D, int I, int has_limit, \
                             float limit) {                                                                   \
        (void)x, (void)xs, (void)w13p, (void)w2p, (void)tw, (void)ids, (void)out, (void)T_, (void)k, (void)E; \
        (void)D, (void)I, (void)has_limit, (void)limit;                                                       \
        return 1;                                                                                             \
    }
#if !defined(__AVX512F__)
DECLINE(f32)
#endif
#if !defined(HAVE_BF16_PANELS)
DECLINE(bf16)
#endif
