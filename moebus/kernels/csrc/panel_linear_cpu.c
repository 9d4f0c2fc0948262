/* A linear for few rows: out[M, N] = x[M, K] . w[N, K]^T (+ bias), float32 sums (rounded to bf16
 * once for bf16, or stored as float32 by the bf16f entry: an LM head's logits), as
 * kernels/panel_linear.py's reference does. bf16 on vdpbf16ps,
 * float32 on AVX-512 FMAs.
 *
 * The weight comes as kernels/lm_head_argmax.py's pack_panels lays it out: panels of 16 output
 * rows; bf16 wp [N / 16][K / 2][16][2], a panel's 16 columns at one k pair in one 64-byte load,
 * which vdpbf16ps multiplies by a broadcast pair of x; float32 wp [N / 16][K][16], 16 columns at
 * one k against a broadcast x. Either way a "step" of k is 4 bytes of an x row and 64 of a panel. Why a kernel of our own: at decode sizes (2-32
 * rows) oneDNN's packed GEMM reaches a fraction of the core's dot-product rate, and each weight is
 * read from memory once a step, cold; here a register tile holds R rows x C panels of accumulators
 * (more panels for fewer rows, so that each weight load feeds several products), the next panels are
 * prefetched while these are summed, and threads take groups of panels dynamically, so a thread
 * that loses its core for a while does not hold the others at the end of the call.
 *
 * Each row's sums run over k in the same order whatever M is: a row's result does not depend on
 * the other rows (batch invariance). Returns 1 (the caller falls back) for shapes outside it: N
 * not a multiple of 16, bf16 K not of 32, or a build without AVX512-BF16 (bf16) or AVX-512 (float32).
 */
#include "cpu_common.h"
#include "panel_tiles.h"

#if defined(__AVX512F__)
/* The entry point: strides in elements, as the Python side passes them; XES and ES are the input's
 * and the output's element sizes. */
#define DEFINE_PANEL_LINEAR(T, XES, ES, STEP_K)                                                                  \
    int panel_linear_##T(const void *x, int64_t xs, const void *wp, const float *bias, int64_t M, int64_t N, \
                         int64_t K, void *out, int64_t os) {                                                \
        if ((STEP_K == 2 && K % 32) || N % NR || K <= 0 || N <= 0 || M <= 0) return 1;                     \
        const int steps = (int)(K / STEP_K);                                                                \
        const int64_t P = N / NR, pstride = (int64_t)steps * 64, tasks = (P + GROUP - 1) / GROUP;           \
        _Pragma("omp parallel for schedule(guided) if (M * N * K >= 262144)")                             \
        for (int64_t t = 0; t < tasks; t++) {                                                               \
            const int64_t p0 = t * GROUP, p1 = p0 + GROUP < P ? p0 + GROUP : P;                             \
            const int64_t q1 = p1 + GROUP < P ? p1 + GROUP : P;                                             \
            for (int64_t m0 = 0; m0 < M; m0 += ROWS) {                                                      \
                const int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;                                      \
                int64_t n;                                                                                  \
                const int64_t o = pf_slice((q1 - p1) * pstride, m0, rows, M, &n);                          \
                const char *pf = n > 0 ? (const char *)wp + p1 * pstride + o : 0;                           \
                panels_rows_##T((const char *)x + m0 * xs * XES, xs * XES, (const char *)wp, pstride, steps,  \
                                bias, (char *)out + m0 * os * ES, os * ES, rows, p0, p1, pf, n);            \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }
/* The next task's panels are fetched while this task's row blocks run (panel_tiles.h, pf_slice):
 * guided chunks are runs of tasks, so the thread that prefetched them takes them next (with
 * schedule(dynamic, 1) the other thread often did, and a whole process ran at the speed of no
 * prefetch: bf16 16 rows 17.7 vs 11.7 ms); the chunks still shrink toward the end, so a thread that
 * lost its core for a while leaves the rest to the others. */

DEFINE_PANELS_ROWS(f32, 4)
DEFINE_PANEL_LINEAR(f32, 4, 4, 1)
#if defined(__AVX512BF16__)
DEFINE_PANELS_ROWS(bf16, 2)
DEFINE_PANEL_LINEAR(bf16, 2, 2, 2)
DEFINE_PANELS_ROWS(bf16f, 4)
DEFINE_PANEL_LINEAR(bf16f, 2, 4, 2)
#define HAVE_BF16_ENTRY 1
#endif
#endif

#define DECLINE(T)                                                                                          \
    int panel_linear_##T(const void *x, int64_t xs, const void *wp, const float *bias, int64_t M, int64_t N, \
                         int64_t K, void *out, int64_t os) {                                                \
        (void)x, (void)xs, (void)wp, (void)bias, (void)M, (void)N, (void)K, (void)out, (void)os;          \
        return 1;                                                                                           \
    }
#if !defined(__AVX512F__)
DECLINE(f32)
#endif
#if !defined(HAVE_BF16_ENTRY)
DECLINE(bf16)
DECLINE(bf16f)
#endif
