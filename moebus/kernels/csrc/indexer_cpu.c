/* DeepSeek-V4 lightning-indexer top-k (kernels/indexer_topk.py). Per query row r:
 * score[e] = sum_h w[r,h] * relu(q[r,h] . keys[start[r]+e]) * scale for e < n_visible[r], then the
 * k best e (descending score, ties to the lower e) through a size-k heap whose root is the worst
 * kept entry; -1 fills the rest. float32 math; rows run in parallel. */
#include <stdlib.h>

#include "cpu_common.h"

#define MAXD 1024

typedef struct {
    float s;
    int64_t e;
} entry;

/* a ranks below b: lower score, or equal score and higher index. */
INLINE int worse(entry a, entry b) { return a.s < b.s || (a.s == b.s && a.e > b.e); }

INLINE void sift_down(entry *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && worse(h[l], h[m])) m = l;
        if (l + 1 < n && worse(h[l + 1], h[m])) m = l + 1;
        if (m == i) return;
        entry tmp = h[i];
        h[i] = h[m], h[m] = tmp, i = m;
    }
}

static int better_first(const void *a, const void *b) {
    const entry x = *(const entry *)a, y = *(const entry *)b;
    return worse(y, x) ? -1 : (worse(x, y) ? 1 : 0);
}

INLINE int topk_impl(enum dtype t, const void *q, const float *w, const void *keys, const int64_t *start,
                     const int64_t *nvis, int64_t *out, int64_t rows, int H, int D, int k, float scale) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
        const int es = t == F32 ? 4 : 2;
        float kr[MAXD];
        float *qr = malloc((size_t)H * D * sizeof(float));
        entry *heap = malloc((size_t)(k > 0 ? k : 1) * sizeof(entry));
        if (!qr || !heap) {
            failed = 1;
            free(qr), free(heap);
            continue;
        }
        for (int h = 0; h < H; h++) load_row(t, qr + (int64_t)h * D, (const char *)q + ((r * H + h) * (int64_t)D) * es, D);
        int n = 0;
        for (int64_t e = 0; e < nvis[r]; e++) {
            load_row(t, kr, (const char *)keys + ((start[r] + e) * (int64_t)D) * es, D);
            float s = 0.f;
            for (int h = 0; h < H; h++) {
                float dot = 0.f;
                for (int i = 0; i < D; i++) dot += qr[(int64_t)h * D + i] * kr[i];
                s += (dot > 0.f ? dot : 0.f) * scale * w[r * H + h];
            }
            const entry cand = {s, e};
            if (n < k) {
                heap[n++] = cand;
                if (n == k)
                    for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
            } else if (k > 0 && worse(heap[0], cand)) {
                heap[0] = cand;
                sift_down(heap, k, 0);
            }
        }
        qsort(heap, (size_t)n, sizeof(entry), better_first);
        for (int i = 0; i < k; i++) out[r * k + i] = i < n ? heap[i].e : -1;
        free(qr), free(heap);
    }
    return failed;
}

#define DEFINE(SUFFIX, T)                                                                              \
    int indexer_topk_##SUFFIX(const void *q, const float *w, const void *keys, const int64_t *start,     \
                              const int64_t *nvis, int64_t *out, int64_t rows, int H, int D, int k,     \
                              float scale) {                                                            \
        if (D > MAXD) return 1;                                                                        \
        return topk_impl(T, q, w, keys, start, nvis, out, rows, H, D, k, scale);                       \
    }
DEFINE(f32, F32)
DEFINE(bf16, BF16)
DEFINE(f16, F16)
