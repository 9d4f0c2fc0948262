/* Row argmax, torch's max(dim=1).indices semantics (kernels/argmax.py is the spec): the first
 * maximum of each row, or the row's first NaN. x [B, N] with row stride rs (elements), out [B]
 * int64. Rows run in parallel; a row is read in blocks of BLK whose max is a vectorised reduction
 * (NaN-free blocks) and only the winning block is scanned again for its first maximum.
 */
#include "cpu_common.h"

#define BLK 512

INLINE int64_t argmax_row(enum dtype t, const char *row, int64_t n, int es) {
    float best = -INFINITY;
    int64_t best_blk = 0;
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        const int len = n - b0 < BLK ? (int)(n - b0) : BLK;
        float buf[BLK];
        load_row(t, buf, row + b0 * es, len);
        int nan;
        const float m = block_max(buf, len, &nan);
        if (nan)
            for (int i = 0; i < len; i++)
                if (buf[i] != buf[i]) return b0 + i;
        if (m > best) best = m, best_blk = b0;
    }
    const int len = n - best_blk < BLK ? (int)(n - best_blk) : BLK;
    float buf[BLK];
    load_row(t, buf, row + best_blk * es, len);
    for (int i = 0; i < len; i++)
        if (buf[i] == best) return best_blk + i;
    return best_blk; /* every value -inf: the first one */
}

#define DEFINE_ROW_ARGMAX(SUFFIX, DT, ES)                                                        \
    int row_argmax_##SUFFIX(const void *x, int64_t rs, int64_t rows, int64_t n, int64_t *out) {  \
        _Pragma("omp parallel for schedule(static) if (rows * n >= 65536)")                      \
        for (int64_t r = 0; r < rows; r++)                                                       \
            out[r] = argmax_row(DT, (const char *)x + r * rs * ES, n, ES);                       \
        return 0;                                                                                \
    }

DEFINE_ROW_ARGMAX(f32, F32, 4)
DEFINE_ROW_ARGMAX(bf16, BF16, 2)
DEFINE_ROW_ARGMAX(f16, F16, 2)
