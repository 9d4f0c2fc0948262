/* One batch-1 decode step of a llama decoder stack in one call: for each layer RMSNorm -> QKV
 * GEMV -> rotary -> K/V into the paged cache -> attention over the sequence -> O GEMV + residual
 * -> RMSNorm -> gate/up GEMV -> SiLU * up -> down GEMV + residual, then the final RMSNorm.
 *
 * Why: one token through SmolLM2's 30 layers is ~270 module calls and ~360 tensor allocations;
 * at batch 1 nothing amortises that host work and it cost more than the GEMVs (Zen 3 profile:
 * ~15 of 31 ms). Here the step is C end to end, on scratch the caller allocates once.
 *
 * The semantics are the engine's module path (engine/models/llama.py: the torch reference the
 * tests compare with). The GEMVs are those the module path's linear layers take for one row, from
 * the same headers: GGUF blocks on integer activations (quant_dot.h) or on float activations
 * (quant_direct.h), float32 weights on cpu_dot.h's tiles (the module path there is torch's GEMM:
 * results differ by summation order). Layouts: caches float32 [blocks, bs, Hkv, D], contiguous;
 * cos / sin float32 [max_pos, D / 2] (neox rotary over the whole head); norms float32 [hidden].
 *
 * MoE decoder layers (engine/models/moe_decoder.py: Qwen3-MoE, Mixtral, OLMoE, GraniteMoE) take the
 * same chain with their knobs (q/k RMSNorm per head or over the projection, QKV clipping, a
 * softmax scale, an output scale on O) and, in place of gate/up and down, the routed experts:
 * a float32 router GEMV and top-k, then each chosen expert's gate|up and down on qpanel.h's
 * panels with the arithmetic of kernels/qmoe.py's kernel (csrc/qmoe_cpu.c), combined in float32
 * in top-k order.
 *
 * bf16 models (dmodel.bf16): the embedding and the caches are bf16 ([blocks, bs, Hkv, D]). Their
 * linear layers (W_BF16) and experts (dmoe.qt W_BF16) are pack_panels' bf16 panels taken on
 * vdpbf16ps with panel_tiles.h's tiles, the attention is paged_decode.h's decode_one a kv head at a
 * time, the SwiGLU elementwise_avx512.h's and the norms sum in its order: the module path's own
 * arithmetic. Every value the module path holds in a bf16 tensor is rounded to bf16 here at the same
 * point (the residual stream after each add, each norm's output, the projections' and experts'
 * outputs, q and k after their norms and after rotary, the attention's output, O's output and its
 * scaled copy, SiLU * up), so a lone request's step is the batched module path's to the bit (engine
 * batch invariance by default); only the routing softmax runs in another order (route()).
 */
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "paged_decode.h"
#include "qpanel.h"
#include "quant_direct.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "panel_tiles.h"
DEFINE_PANELS_ROWS(bf16f, 4) /* bf16 x bf16 -> float32 sums, as panel_linear_cpu.c's bf16f entry */
#define MAXN 16384           /* elementwise_avx512.h's row bound (its norm; the step uses its SiLU) */
#include "elementwise_avx512.h"
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

#define W_F32 0           /* dlinear.kind of a float32 weight; else the GGUF type id */
#define W_BF16 32         /* bf16 pack_panels panels [n / 16][k / 2][16][2] (w), on bf16-rounded inputs */
#define W_PANEL 64        /* + the GGUF type id: qpanel.h's panels (w), on 16-bit activations */
#define SPINS 4096        /* polls of a phase counter before yielding the core */

struct dlinear {
    const void *w; /* float32 [n, k], GGUF blocks [n, k / 32 * block bytes] or panels */
    int64_t ws;    /* row stride in bytes */
    int32_t kind;  /* W_F32 or a GGUF type id */
    int32_t bits;  /* GGUF: 16 or 8 = integer activations of that width, 0 = float activations */
    int32_t n, k;
};

/* A layer's routed experts (n_experts 0: the layer has a dense gate/up, down MLP instead). */
struct dmoe {
    const float *router;      /* float32 [n_experts, hidden] */
    const uint8_t *p13, *p2;  /* each expert's [2 inter, hidden] / [hidden, inter] panels, back to back */
    int32_t qt, qt2, n_experts, top_k, inter; /* p13's block type, p2's (W_BF16: bf16 pack_panels panels) */
    int32_t renorm;           /* 1: softmax over the top-k logits; 0: softmax over all, top-k of it */
    float route_scale;        /* times every combine weight */
};

struct dlayer {
    const float *in_norm, *post_norm;
    struct dlinear qkv, o, gate_up, down;
    const float *q_norm, *k_norm; /* qk_norm 1: [hd] shared by the heads; 2: [nh hd] / [nkv hd] */
    int32_t qk_norm;              /* 0 none, 1 per head, 2 over the whole projection */
    float clip;                   /* > 0: q, k, v clamped to [-clip, clip] */
    float o_scale;                /* O's output times this before the residual add */
    struct dmoe moe;
};

struct dmodel {
    int32_t n_layers, hidden, inter, nh, nkv, hd, block_size, max_pos;
    float eps, scale;
    const float *final_norm, *cos, *sin;
    const struct dlayer *layers;
    float emb_scale;             /* the token's embedding row times this */
    int32_t max_experts, max_k, max_moe_inter; /* over the MoE layers (0: none), for the scratch */
    int32_t bf16;                /* 1: a bf16 model: bf16 embedding and caches, the module path's bf16 roundings */
};

/* Whether this build takes bf16 models and W_BF16 weights (AVX512-BF16). */
int decode_stack_bf16(void) { return HAVE_BF16; }

/* x [n] rounded to bf16 in place (nearest even, as torch). */
static void round_bf16(float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = round_to(BF16, x[i]);
}

/* x rounded to bf16 in a bf16 model (bf: dmodel.bf16), else x. */
INLINE float rb(int bf, float x) { return bf ? round_to(BF16, x) : x; }

/* Scratch floats. Shared: the layer's activations (qkv, attention out, projection out, gate/up);
 * per thread: the normed row, the rotated K/V of this token, the scores over ctx positions and the
 * quantized row (int16 K + (d, d * sum) pairs, or the block sums), each padded to 64 bytes. */
static int64_t per_thread(const struct dmodel *m, int64_t ctx) {
    int64_t kmax = m->hidden > m->inter ? m->hidden : m->inter;
    kmax = kmax > (int64_t)m->nh * m->hd ? kmax : (int64_t)m->nh * m->hd;
    const int64_t ka = (int64_t)m->max_k * m->max_moe_inter; /* the chosen experts' quantized act rows */
    kmax = kmax > ka ? kmax : ka;
    const int64_t qo = (int64_t)(m->nh / m->nkv) * m->hd; /* a bf16 kv head's q and output, bf16 */
    return (m->hidden + 2 * (int64_t)m->nkv * m->hd + qo + ctx + kmax / 2 + 2 * (kmax / QK) + 2 * m->max_experts +
            7 * 16 + 15) & ~15;
}

static int64_t shared_floats(const struct dmodel *m) {
    const int64_t qkv = (int64_t)(m->nh + 2 * m->nkv) * m->hd;
    const int64_t moe = (int64_t)m->max_k * (3 * (int64_t)m->max_moe_inter + m->hidden + 2); /* gate|up, act, y, routing */
    const int64_t mlp = 3 * (int64_t)m->inter > moe ? 3 * (int64_t)m->inter : moe;
    return (qkv + (int64_t)m->nh * m->hd + m->hidden + mlp + 16 + 15) & ~15;
}

int64_t decode_stack_scratch(const struct dmodel *m, int64_t max_ctx) {
    return shared_floats(m) + omp_get_max_threads() * per_thread(m, max_ctx) + 16;
}

/* The step is a chain of phases (5 a layer); a phase's work is split in chunks (rows of a GEMV,
 * heads of attention) that threads claim from a counter, and a phase's inputs are ready when every
 * chunk of the phase before it is done. A thread that is off-CPU (a loaded box) holds back only the
 * chunk it holds: the others claim the rest and move on, where a barrier would wait for it at every
 * phase (measured on 2 shared cores: static shares with a spinning barrier 4.2 ms a step or 17 ms,
 * by the load). Results do not depend on which thread computes a chunk. */
struct phase {
    _Atomic int claimed, done;
    char pad[56]; /* one cache line a phase */
};

/* Spins (SPINS polls, then yielding the core each poll) until every chunk of ph is done. */
static void wait_done(struct phase *ph, int total) {
    for (int i = 0; atomic_load_explicit(&ph->done, memory_order_acquire) < total; i++) {
        if (i < SPINS) {
#if MOEBUS_DOT_AVX2
            _mm_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* The next unclaimed chunk of ph, or -1. */
static int claim(struct phase *ph, int total) {
    if (atomic_load_explicit(&ph->claimed, memory_order_relaxed) >= total) return -1;
    const int c = atomic_fetch_add_explicit(&ph->claimed, 1, memory_order_relaxed);
    return c < total ? c : -1;
}

static void finish(struct phase *ph) { atomic_fetch_add_explicit(&ph->done, 1, memory_order_release); }

#define CHUNK 128 /* GEMV rows a chunk (64: a step ~4% slower on 2 threads, more cold prefetch starts) */

static int chunks(int64_t n) { return (int)((n + CHUNK - 1) / CHUNK); }

/* The row x prepared for L's GEMV in qbuf: quantized (integer activations) or its block sums. */
static void prepare(const struct dlinear *L, const float *x, void *qbuf) {
    const int nb = L->k / QK;
    float *dd = (float *)((char *)qbuf + (int64_t)L->k * 2);
    if (L->kind == W_BF16) {
        store_row(BF16, qbuf, x, 1.f, L->k);
    } else if (L->kind > W_PANEL) {
        quantize_row(1, 0, x, nb, qbuf, dd, dd + 1, 2);
    } else if (L->kind != W_F32 && L->bits) {
        quantize_row(L->bits == 16, nibble_order(L->kind, L->bits == 16), x, nb, qbuf, dd, dd + 1, 2);
    } else if (L->kind != W_F32) {
        for (int b = 0; b < nb; b++) {
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += x[b * QK + j];
            dd[b] = s;
        }
    }
}

/* out[n] = L_n . x for weight rows [n0, n1), x prepared in qbuf. */
static void linear_rows(const struct dlinear *L, const float *x, const void *qbuf, int64_t n0, int64_t n1,
                        float *out) {
    if (n0 >= n1) return;
    const int nb = L->k / QK;
    const float *dd = (const float *)((const char *)qbuf + (int64_t)L->k * 2);
    const uint8_t *w = L->w;
    const int64_t N = L->n;
    if (L->kind == W_BF16) {
#if HAVE_BF16 /* n0, n1 on panel bounds: CHUNK and n are multiples of 16 */
        panels_rows_bf16f(qbuf, 0, (const char *)w, (int64_t)L->k * 32, L->k / 2, 0, (char *)out, 0, 1, n0 / NR,
                          n1 / NR, 0, 0);
#endif
    } else if (L->kind > W_PANEL) {
        switch (L->kind - W_PANEL) {
        case Q4_0: qp_rows(Q4_0, w, nb, qbuf, dd, L->k, 1, n0, n1, out, N); break;
        case Q4_1: qp_rows(Q4_1, w, nb, qbuf, dd, L->k, 1, n0, n1, out, N); break;
        default: qp_rows(Q8_0, w, nb, qbuf, dd, L->k, 1, n0, n1, out, N);
        }
    } else if (L->kind == W_F32) {
        const float *rows[1] = {x};
        float *dst[1] = {out + n0};
        dots_rows(F32, 4, (const char *)w + n0 * L->ws, L->ws, (int)(n1 - n0), rows, 1, L->k, dst);
    } else if (L->bits) { /* type and width compile-time constants in each instance */
#define QA_TYPES(WIDE)                                                                  \
    switch (L->kind) {                                                                  \
    case Q4_0: qa_path(Q4_0, WIDE, qbuf, dd, nb, w, L->ws, 1, n0, n1, out, N); break; \
    case Q4_1: qa_path(Q4_1, WIDE, qbuf, dd, nb, w, L->ws, 1, n0, n1, out, N); break; \
    default: qa_path(Q8_0, WIDE, qbuf, dd, nb, w, L->ws, 1, n0, n1, out, N);          \
    }
        if (L->bits == 16) QA_TYPES(1) else QA_TYPES(0)
#undef QA_TYPES
    } else {
        switch (L->kind) {
        case Q4_0: direct_path(Q4_0, x, L->k, dd, nb, w, L->ws, 1, n0, n1, out, N); break;
        case Q4_1: direct_path(Q4_1, x, L->k, dd, nb, w, L->ws, 1, n0, n1, out, N); break;
        default: direct_path(Q8_0, x, L->k, dd, nb, w, L->ws, 1, n0, n1, out, N);
        }
    }
}

/* The sum of x^2. In a bf16 model (bf) in the order of the module path's norm (elementwise_avx512.h's
 * norm_row16: 16 fma lanes, one reduce), so that the norm's bf16 output is its bits. */
static float sum_sq(const float *x, int64_t n, int bf) {
#if HAVE_BF16
    if (bf) {
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 a = _mm512_maskz_loadu_ps(tail16((int)(n - i < 16 ? n - i : 16)), x + i);
            ss = _mm512_fmadd_ps(a, a, ss);
        }
        return hsum16(ss);
    }
#endif
    (void)bf;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return ss;
}

/* out = x * rsqrt(mean(x^2) + eps) * w, as kernels/rmsnorm.py's reference (bf: sum_sq's). */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out, int bf) {
    float ss = 0.f;
    if (bf) {
        ss = sum_sq(x, n, bf);
    } else {
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += x[i] * x[i];
    }
    const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Neox rotary (rotate halves) of one head of width d at x into o (may alias x). */
static void rotate(const float *x, float *o, int d, const float *c, const float *s) {
    const int half = d / 2;
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i] + a * s[i];
    }
}

#define KV_AHEAD 8 /* cache rows the attention loops prefetch ahead in a block */

/* The n floats at p into the cache, a line at a time (the rows are strided: no streamer helps). */
static inline void prefetch_row(const float *p, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* q . k * scale for one cached or current key row. AVX2: 4 independent 8-lane chains (a single
 * chain over hd, as the compiler made of the plain loop, bound a score at hd / 8 FMA latencies plus
 * a serial horizontal sum: most of the attention's time, ~40 ns a head and position). */
static inline float score(const float *q, const float *kp, int hd, float scale) {
#if MOEBUS_DOT_AVX2
    if (hd % 32 == 0) {
        __m256 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), _mm256_loadu_ps(kp + 8 * j));
        for (int i = 32; i < hd; i += 32)
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8 * j), _mm256_loadu_ps(kp + i + 8 * j), a[j]);
        const __m256 t = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v))) * scale;
    }
#endif
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < hd; i++) acc += q[i] * kp[i];
    return acc * scale;
}

#define VT 64 /* output columns a register tile of the weighted V sum (8 AVX2 registers) */

/* o = (sum_p s[p] v_p) * inv over the cached positions (kv head offset off), then this token's v
 * (weight s[cached]). AVX2, hd a multiple of VT: the sums of a column tile stay in registers over
 * all positions (the plain loop loaded and stored o at every position); each element's terms are
 * added in the same order either way. */
static void weighted_v(const float *vc, const int32_t *table, int bs, int64_t row, int64_t off, int cached,
                       const float *s, const float *v, int hd, float inv, float *o) {
#if MOEBUS_DOT_AVX2
    if (hd % VT == 0) {
        for (int c0 = 0; c0 < hd; c0 += VT) {
            __m256 acc[VT / 8];
            for (int i = 0; i < VT / 8; i++) acc[i] = _mm256_setzero_ps();
            for (int p0 = 0; p0 < cached; p0 += bs) {
                const int n = cached - p0 < bs ? cached - p0 : bs;
                const float *vb = vc + (int64_t)table[p0 / bs] * bs * row + off + c0;
                for (int j = 0; j < n; j++) {
                    if (j + KV_AHEAD < n) prefetch_row(vb + (j + KV_AHEAD) * row, VT);
                    const __m256 w = _mm256_set1_ps(s[p0 + j]);
                    for (int i = 0; i < VT / 8; i++)
                        acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vb + j * row + 8 * i), acc[i]);
                }
            }
            const __m256 w = _mm256_set1_ps(s[cached]), iv = _mm256_set1_ps(inv);
            for (int i = 0; i < VT / 8; i++)
                _mm256_storeu_ps(o + c0 + 8 * i,
                                 _mm256_mul_ps(_mm256_fmadd_ps(w, _mm256_loadu_ps(v + c0 + 8 * i), acc[i]), iv));
        }
        return;
    }
#endif
    for (int i = 0; i < hd; i++) o[i] = 0.f;
    for (int p0 = 0; p0 < cached; p0 += bs) {
        const int n = cached - p0 < bs ? cached - p0 : bs;
        const float *vb = vc + (int64_t)table[p0 / bs] * bs * row + off;
        for (int j = 0; j < n; j++) {
            if (j + KV_AHEAD < n) prefetch_row(vb + (j + KV_AHEAD) * row, hd);
            const float *vp = vb + j * row, w = s[p0 + j];
#pragma omp simd
            for (int i = 0; i < hd; i++) o[i] += w * vp[i];
        }
    }
    const float wl = s[cached];
#pragma omp simd
    for (int i = 0; i < hd; i++) o[i] = (o[i] + wl * v[i]) * inv;
}

/* Softmax attention of one query head q over positions [0, len): [0, len - 1) from the paged cache
 * (kv head offset off), the last from this token's k / v. The cache is walked a block at a time
 * (one table lookup a block), rows prefetched KV_AHEAD ahead. */
static void attend_head(const struct dmodel *m, const float *q, const float *kc, const float *vc,
                        const int32_t *table, int len, int64_t off, const float *k, const float *v, float *s,
                        float *o) {
    const int hd = m->hd, bs = m->block_size, cached = len - 1;
    const int64_t row = (int64_t)m->nkv * hd; /* floats a cache slot */
    for (int p0 = 0; p0 < cached; p0 += bs) {
        const int n = cached - p0 < bs ? cached - p0 : bs;
        const float *kb = kc + (int64_t)table[p0 / bs] * bs * row + off;
        for (int i = 0; i < n; i++) {
            if (i + KV_AHEAD < n) prefetch_row(kb + (i + KV_AHEAD) * row, hd);
            s[p0 + i] = score(q, kb + i * row, hd, m->scale);
        }
    }
    s[cached] = score(q, k, hd, m->scale);
    int nan;
    const float mx = block_max(s, len, &nan); /* a NaN score propagates through the sums either way */
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int p = 0; p < len; p++) {
        s[p] = fast_exp(s[p] - mx);
        sum += s[p];
    }
    weighted_v(vc, table, bs, row, off, cached, s, v, hd, 1.f / sum /* >= 1: the maximum's term */, o);
}

/* A bf16 model's attention for kv head kh's G query heads: paged_decode.h's decode_one (the module
 * path's kernel, so its bits) over positions [0, len) of the cache, which holds this token's K/V
 * already; qb: the G heads' q (bf16), ob: their output (bf16). */
static void attend_kv_head_bf16(const struct dmodel *m, const uint16_t *qb, const char *kc, const char *vc,
                                const int32_t *table, int len, int kh, uint16_t *ob) {
    const int hd = m->hd, G = m->nh / m->nkv, bs = m->block_size;
    const int64_t ss = (int64_t)m->nkv * hd; /* a slot's elements */
    const char *k = kc + (int64_t)kh * hd * 2, *v = vc + (int64_t)kh * hd * 2;
#define ONE(D)                                                                                                    \
    decode_one(BF16, 2, (const char *)qb, hd, k, bs * ss, ss, hd, v, bs * ss, ss, hd, table, len, table, 0, 0,     \
               (char *)ob, hd, G, 1, D, D, bs, 0, m->scale, 0)
    if (hd == 64) ONE(64); /* constant head dims unroll its row loops, as paged_attention_cpu.c does */
    else if (hd == 128) ONE(128);
    else ONE(hd);
#undef ONE
}

static void clip_row(float *x, int64_t n, float c) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = x[i] > c ? c : (x[i] < -c ? -c : x[i]);
}

/* x * rsqrt(ss / n + eps) * w for a row whose sum of squares ss was taken already. */
static void scale_row(const float *x, const float *w, int64_t n, float r, float *out) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}


/* The router's logits [E] of the normed row xn: its weight in pack_panels' float32 layout ([E / 16]
 * panels of [hidden][16]), each logit a float32 fma chain over k in order: the panel kernel's
 * arithmetic (kernels/panel_linear.py), so the module path's logits to the bit. */
static void router_logits(const struct dmoe *M, const float *xn, int H, float *logits) {
    const int P = (M->n_experts + 15) / 16;
    for (int p = 0; p < P; p++) {
        const float *w = M->router + (int64_t)p * H * 16;
        float acc[16] = {0};
#if defined(__AVX512F__)
        __m512 a = _mm512_setzero_ps();
        for (int k = 0; k < H; k++) a = _mm512_fmadd_ps(_mm512_set1_ps(xn[k]), _mm512_loadu_ps(w + k * 16), a);
        _mm512_storeu_ps(acc, a);
#else
        for (int k = 0; k < H; k++)
            for (int c = 0; c < 16; c++) acc[c] = fmaf(xn[k], w[k * 16 + c], acc[c]);
#endif
        for (int c = 0; c < 16 && p * 16 + c < M->n_experts; c++) logits[p * 16 + c] = acc[c];
    }
}

/* The top_k experts of the logits (sel, best first; ties to the lower id) and their combine weights:
 * renorm, a softmax over the chosen logits (== softmax, top-k, renormalise); else the softmax over
 * all experts at the chosen ones. Both times route_scale. */
static void route(const struct dmoe *M, const float *logits, int *sel, float *w) {
    const int E = M->n_experts, K = M->top_k;
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= sel[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        sel[j] = best;
    }
    const float mx = logits[sel[0]];
    float sum = 0.f;
    if (M->renorm) {
        for (int j = 0; j < K; j++) sum += w[j] = expf(logits[sel[j]] - mx);
    } else {
        for (int e = 0; e < E; e++) sum += expf(logits[e] - mx);
        for (int j = 0; j < K; j++) w[j] = expf(logits[sel[j]] - mx);
    }
    for (int j = 0; j < K; j++) w[j] = w[j] / sum * M->route_scale;
}

/* Rows [n0, n1) of expert e's panels (p: the experts' panels, each `stride` bytes) on the prepared row. */
static void expert_rows(int qt, const uint8_t *p, int64_t stride, int e, int64_t K, const int16_t *xq,
                        const float *dd, int64_t n0, int64_t n1, float *out) {
    const uint8_t *w = p + e * stride;
    const int nb = (int)(K / QK);
    if (qt == W_BF16) { /* xq: the bf16 row; rows on panel bounds */
#if HAVE_BF16
        panels_rows_bf16f((const char *)xq, 0, (const char *)w, K * 32, (int)(K / 2), 0, (char *)out, 0, 1,
                          n0 / NR, n1 / NR, 0, 0);
#endif
        return;
    }
    switch (qt) {
    case Q4_0: qp_rows(Q4_0, w, nb, xq, dd, K, 1, n0, n1, out, 0); break;
    case Q4_1: qp_rows(Q4_1, w, nb, xq, dd, K, 1, n0, n1, out, 0); break;
    default: qp_rows(Q8_0, w, nb, xq, dd, K, 1, n0, n1, out, 0);
    }
}

static int64_t expert_bytes(int qt, int64_t n, int64_t k) {
    return qt == W_BF16 ? n * k * 2 : (n + QP_W - 1) / QP_W * (k / QK) * qp_block_bytes(qt);
}

/* The row x [k] as expert_rows' input in buf: bf16 (W_BF16) or int16 with its (d, d * sum) pairs at dd. */
static void expert_input(int qt, const float *x, int64_t k, int16_t *buf, float *dd) {
    if (qt == W_BF16) store_row(BF16, buf, x, 1.f, (int)k);
    else quantize_row(1, 0, x, (int)(k / QK), buf, dd, dd + 1, 2);
}

/* Chunks of the layer's phases: QKV rows, heads, O rows, then gate/up rows and down rows (dense) or
 * (chosen expert, gate|up rows) and down rows over the chosen experts (MoE). */
static void layer_totals(const struct dmodel *m, const struct dlayer *L, int *total) {
    total[0] = chunks((int64_t)(m->nh + 2 * m->nkv) * m->hd), total[1] = m->bf16 ? m->nkv : m->nh;
    total[2] = chunks(m->hidden);
    total[3] = L->moe.n_experts ? L->moe.top_k * chunks(L->moe.inter) : chunks(m->inter);
    total[4] = chunks(m->hidden);
}

/* h [hidden]: this token's embedding in, the residual stream after the last layer out; out
 * [hidden] = final_norm(h). The token sits at position pos = seq_len - 1 in cache slot `slot`
 * (its place in `table`) and attends to positions [0, seq_len). k_caches / v_caches: one per
 * layer. One parallel region for the whole step, phases as above; before claiming a phase's chunks
 * a thread recomputes that phase's cheap shared input itself (the normed, quantized row; this
 * token's rotated K/V; an MoE layer's routing). Returns 0; 1 when the arguments do not fit (the
 * caller falls back). */
int decode_stack_f32(const struct dmodel *m, float *h, float *out, int64_t pos, int64_t slot, int64_t seq_len,
                     const int32_t *table, float *const *k_caches, float *const *v_caches, float *scratch,
                     int64_t scratch_len) {
    const int bs = m->block_size;
    if (pos < 0 || pos >= m->max_pos || pos != seq_len - 1 || bs <= 0 || m->hd % 2 || m->nh % m->nkv ||
        slot != (int64_t)table[pos / bs] * bs + pos % bs || scratch_len < decode_stack_scratch(m, seq_len) ||
        (m->bf16 && (!HAVE_BF16 || m->nh / m->nkv > MAXHQ || m->hd > MAXD)))
        return 1;
    for (int l = 0; !HAVE_BF16 && l < m->n_layers; l++) {
        const struct dlayer *L = m->layers + l;
        if (L->qkv.kind == W_BF16 || L->o.kind == W_BF16 || L->gate_up.kind == W_BF16 || L->down.kind == W_BF16 ||
            (L->moe.n_experts && (L->moe.qt == W_BF16 || L->moe.qt2 == W_BF16)))
            return 1;
    }
    const int H = m->hidden, I = m->inter, hd = m->hd, g = m->nh / m->nkv, len = (int)seq_len;
    const int64_t nq = (int64_t)m->nh * hd, nk = (int64_t)m->nkv * hd, pt = per_thread(m, seq_len);
    float *qkv = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63), *att = qkv + nq + 2 * nk;
    float *tmp = att + nq, *gu = tmp + H, *priv = qkv + shared_floats(m);
    const float *c = m->cos + pos * (hd / 2), *s = m->sin + pos * (hd / 2);
    struct phase *ph = malloc(sizeof(struct phase) * 5 * (size_t)m->n_layers);
    int *totals = malloc(sizeof(int) * 5 * (size_t)m->n_layers);
    if (!ph || !totals) return free(ph), free(totals), 1;
    for (int i = 0; i < 5 * m->n_layers; i++) atomic_init(&ph[i].claimed, 0), atomic_init(&ph[i].done, 0);
    for (int l = 0; l < m->n_layers; l++) layer_totals(m, m->layers + l, totals + 5 * l);
    if (m->bf16) round_bf16(h, H); /* a bf16 model's residual stream holds bf16 values */
#pragma omp parallel
    {
        const int tid = omp_get_thread_num();
        float *xn = priv + tid * pt, *kv = xn + ((H + 15) & ~15), *qo = kv + 2 * nk;
        float *sc = qo + ((g * hd + 15) & ~15);
        float *logits = sc + ((len + 15) & ~15), *wsel = logits + ((m->max_experts + 15) & ~15);
        int *sel = (int *)(wsel + 16 * ((m->max_k + 15) / 16));
        void *qbuf = (float *)sel + 16 * ((m->max_k + 15) / 16);
        for (int l = 0; l < m->n_layers; l++) {
            const struct dlayer *L = m->layers + l;
            const struct dmoe *M = &L->moe;
            const int *total = totals + 5 * l;
            struct phase *P = ph + 5 * l;
            int k;
            if (l > 0) wait_done(P - 1, totals[5 * l - 1]);
            if (atomic_load_explicit(&P[0].claimed, memory_order_relaxed) < total[0]) { /* QKV */
                rms_norm(h, L->in_norm, H, m->eps, xn, m->bf16);
                if (m->bf16) round_bf16(xn, H);
                prepare(&L->qkv, xn, qbuf);
                while ((k = claim(&P[0], total[0])) >= 0) {
                    const int64_t n0 = (int64_t)k * CHUNK, n1 = n0 + CHUNK < L->qkv.n ? n0 + CHUNK : L->qkv.n;
                    linear_rows(&L->qkv, xn, qbuf, n0, n1, qkv);
                    if (m->bf16) round_bf16(qkv + n0, n1 - n0);
                    finish(&P[0]);
                }
            }
            wait_done(&P[0], total[0]);
            if (atomic_load_explicit(&P[1].claimed, memory_order_relaxed) < total[1]) { /* attention */
                float qr = 0.f; /* qk_norm 2: the whole q projection's rsqrt(mean square + eps) */
                if (L->qk_norm == 2) {
                    qr = 1.f / sqrtf(sum_sq(qkv, nq, m->bf16) / (float)nq + m->eps);
                    scale_row(qkv + nq, L->k_norm, nk, 1.f / sqrtf(sum_sq(qkv + nq, nk, m->bf16) / (float)nk + m->eps),
                              kv);
                } else {
                    memcpy(kv, qkv + nq, (size_t)nk * sizeof(float));
                }
                memcpy(kv + nk, qkv + nq + nk, (size_t)nk * sizeof(float));
                for (int j = 0; j < m->nkv; j++) { /* this token's K (normed, clipped, rotated) and V, every thread its copy */
                    if (L->qk_norm == 1) rms_norm(kv + j * hd, L->k_norm, hd, m->eps, kv + j * hd, m->bf16);
                    if (L->qk_norm && m->bf16) round_bf16(kv + j * hd, hd);
                    if (L->clip > 0.f) clip_row(kv + j * hd, hd, L->clip), clip_row(kv + nk + j * hd, hd, L->clip);
                    rotate(kv + j * hd, kv + j * hd, hd, c, s); /* bf16: rounded as it goes into the cache */
                }
                while (m->bf16 && (k = claim(&P[1], total[1])) >= 0) { /* kv head k: its K/V row, then its G heads */
                    uint16_t *qb = (uint16_t *)qo, *ob = qb + (int64_t)g * hd;
                    const int64_t at = (slot * nk + (int64_t)k * hd) * 2;
                    store_row(BF16, (char *)k_caches[l] + at, kv + (int64_t)k * hd, 1.f, hd);
                    store_row(BF16, (char *)v_caches[l] + at, kv + nk + (int64_t)k * hd, 1.f, hd);
                    for (int j = 0; j < g; j++) {
                        const int64_t h = (int64_t)k * g + j;
                        if (L->qk_norm == 1) rms_norm(qkv + h * hd, L->q_norm, hd, m->eps, xn, m->bf16);
                        else if (L->qk_norm == 2) scale_row(qkv + h * hd, L->q_norm + h * hd, hd, qr, xn);
                        else memcpy(xn, qkv + h * hd, (size_t)hd * sizeof(float));
                        if (L->qk_norm) round_bf16(xn, hd);
                        if (L->clip > 0.f) clip_row(xn, hd, L->clip);
                        rotate(xn, xn, hd, c, s);
                        store_row(BF16, qb + (int64_t)j * hd, xn, 1.f, hd);
                    }
                    attend_kv_head_bf16(m, qb, (const char *)k_caches[l], (const char *)v_caches[l], table, len, k, ob);
                    load_row(BF16, att + (int64_t)k * g * hd, ob, g * hd);
                    finish(&P[1]);
                }
                while (!m->bf16 && (k = claim(&P[1], total[1])) >= 0) {
                    if (k == 0) { /* the slot is read by no one this step: attention takes kv */
                        memcpy(k_caches[l] + slot * nk, kv, (size_t)nk * sizeof(float));
                        memcpy(v_caches[l] + slot * nk, kv + nk, (size_t)nk * sizeof(float));
                    }
                    const int64_t off = (int64_t)(k / g) * hd;
                    const float *q = qkv + (int64_t)k * hd; /* xn is free until the next norm */
                    if (L->qk_norm == 1) rms_norm(q, L->q_norm, hd, m->eps, xn, m->bf16);
                    else if (L->qk_norm == 2) scale_row(q, L->q_norm + (int64_t)k * hd, hd, qr, xn);
                    else memcpy(xn, q, (size_t)hd * sizeof(float));
                    if (L->clip > 0.f) clip_row(xn, hd, L->clip);
                    rotate(xn, xn, hd, c, s);
                    attend_head(m, xn, k_caches[l], v_caches[l], table, len, off, kv + off, kv + nk + off, sc,
                                att + (int64_t)k * hd);
                    finish(&P[1]);
                }
            }
            wait_done(&P[1], total[1]);
            if (atomic_load_explicit(&P[2].claimed, memory_order_relaxed) < total[2]) { /* O + residual */
                prepare(&L->o, att, qbuf);
                while ((k = claim(&P[2], total[2])) >= 0) {
                    const int64_t n0 = (int64_t)k * CHUNK, n1 = n0 + CHUNK < H ? n0 + CHUNK : H;
                    linear_rows(&L->o, att, qbuf, n0, n1, tmp);
                    const int bf = m->bf16;
                    if (L->o_scale != 1.f)
                        for (int64_t i = n0; i < n1; i++) h[i] = rb(bf, h[i] + rb(bf, rb(bf, tmp[i]) * L->o_scale));
                    else
                        for (int64_t i = n0; i < n1; i++) h[i] = rb(bf, h[i] + rb(bf, tmp[i]));
                    finish(&P[2]);
                }
            }
            wait_done(&P[2], total[2]);
            if (M->n_experts) { /* routed experts: gate|up of each chosen expert, then down over all of them */
                const int Ie = M->inter, K = M->top_k, ci = chunks(Ie);
                const int64_t s13 = expert_bytes(M->qt, 2 * (int64_t)Ie, H), s2 = expert_bytes(M->qt2, H, Ie);
                float *act = gu + 2 * (int64_t)K * Ie, *y = act + (int64_t)K * Ie, *rw = y + (int64_t)K * H;
                int *rsel = (int *)(rw + K); /* the routing, shared */
                int16_t *xq = qbuf;
                float *xd = (float *)(xq + H);
                if (atomic_load_explicit(&P[3].claimed, memory_order_relaxed) < total[3]) {
                    rms_norm(h, L->post_norm, H, m->eps, xn, m->bf16);
                    if (m->bf16) round_bf16(xn, H);
                    router_logits(M, xn, H, logits);
                    route(M, logits, sel, wsel);
                    expert_input(M->qt, xn, H, xq, xd);
                    while ((k = claim(&P[3], total[3])) >= 0) {
                        const int j = k / ci;
                        const int64_t n0 = (int64_t)(k % ci) * CHUNK, n1 = n0 + CHUNK < Ie ? n0 + CHUNK : Ie;
                        float *gj = gu + 2 * (int64_t)j * Ie, *aj = act + (int64_t)j * Ie;
                        expert_rows(M->qt, M->p13, s13, sel[j], H, xq, xd, n0, n1, gj);
                        expert_rows(M->qt, M->p13, s13, sel[j], H, xq, xd, Ie + n0, Ie + n1, gj);
                        if (m->bf16) round_bf16(gj + n0, n1 - n0), round_bf16(gj + Ie + n0, n1 - n0);
#pragma omp simd
                        for (int64_t i = n0; i < n1; i++) aj[i] = gj[i] / (1.f + fast_exp(-gj[i])) * gj[Ie + i];
                        if (k == 0) /* for the down phase, whose threads may not have routed: h moves then */
                            memcpy(rsel, sel, (size_t)K * sizeof(int)), memcpy(rw, wsel, (size_t)K * sizeof(float));
                        finish(&P[3]);
                    }
                }
                wait_done(&P[3], total[3]);
                if (atomic_load_explicit(&P[4].claimed, memory_order_relaxed) < total[4]) {
                    int16_t *aq = qbuf;
                    float *ad = (float *)(aq + (int64_t)K * Ie);
                    for (int j = 0; j < K; j++)
                        expert_input(M->qt2, act + (int64_t)j * Ie, Ie, aq + (int64_t)j * Ie, ad + 2 * (int64_t)j * (Ie / QK));
                    while ((k = claim(&P[4], total[4])) >= 0) {
                        const int64_t n0 = (int64_t)k * CHUNK, n1 = n0 + CHUNK < H ? n0 + CHUNK : H;
                        for (int j = 0; j < K; j++) {
                            expert_rows(M->qt2, M->p2, s2, rsel[j], Ie, aq + (int64_t)j * Ie,
                                        ad + 2 * (int64_t)j * (Ie / QK), n0, n1, y + (int64_t)j * H);
                            if (m->bf16) round_bf16(y + (int64_t)j * H + n0, n1 - n0);
                        }
                        for (int64_t i = n0; i < n1; i++) { /* sum_j w_j y_j in float32, j in order */
                            float acc = 0.f;
                            for (int j = 0; j < K; j++) acc += rw[j] * y[(int64_t)j * H + i];
                            h[i] = rb(m->bf16, h[i] + rb(m->bf16, acc));
                        }
                        finish(&P[4]);
                    }
                }
                continue;
            }
            float *act = gu + 2 * (int64_t)I;
            if (atomic_load_explicit(&P[3].claimed, memory_order_relaxed) < total[3]) { /* gate/up, SiLU * up */
                rms_norm(h, L->post_norm, H, m->eps, xn, m->bf16);
                if (m->bf16) round_bf16(xn, H);
                prepare(&L->gate_up, xn, qbuf);
                while ((k = claim(&P[3], total[3])) >= 0) {
                    const int64_t n0 = (int64_t)k * CHUNK, n1 = n0 + CHUNK < I ? n0 + CHUNK : I;
                    linear_rows(&L->gate_up, xn, qbuf, n0, n1, gu);
                    linear_rows(&L->gate_up, xn, qbuf, I + n0, I + n1, gu);
                    if (m->bf16) {
                        round_bf16(gu + n0, n1 - n0), round_bf16(gu + I + n0, n1 - n0);
#if HAVE_BF16 /* the module path's SwiGLU kernel (elementwise_cpu.c's), so its bits */
                        silu_block16(F32, (const char *)(gu + n0), (const char *)(gu + I + n0), (char *)(act + n0),
                                     (int)(n1 - n0), 0, 0.f);
#endif
                    } else {
#pragma omp simd
                        for (int64_t i = n0; i < n1; i++) act[i] = gu[i] / (1.f + fast_exp(-gu[i])) * gu[I + i];
                    }
                    finish(&P[3]);
                }
            }
            wait_done(&P[3], total[3]);
            if (atomic_load_explicit(&P[4].claimed, memory_order_relaxed) < total[4]) { /* down + residual */
                prepare(&L->down, act, qbuf);
                while ((k = claim(&P[4], total[4])) >= 0) {
                    const int64_t n0 = (int64_t)k * CHUNK, n1 = n0 + CHUNK < H ? n0 + CHUNK : H;
                    linear_rows(&L->down, act, qbuf, n0, n1, tmp);
                    for (int64_t i = n0; i < n1; i++) h[i] = rb(m->bf16, h[i] + rb(m->bf16, tmp[i]));
                    finish(&P[4]);
                }
            }
        }
        if (tid == 0) {
            wait_done(ph + 5 * m->n_layers - 1, totals[5 * m->n_layers - 1]);
            rms_norm(h, m->final_norm, H, m->eps, out, m->bf16);
        }
    }
    free(ph), free(totals);
    return 0;
}

/* decode_stack_f32 for the token ids[0] at position positions[0] in cache slot slots[0] (the
 * engine's int64 step tensors, read here rather than converted one by one in Python): h = its row
 * of embed ([vocab, hidden], float32 or, for a bf16 model, bf16; row stride es elements), then the step. Returns 1 when the token
 * is outside [0, vocab) or decode_stack_f32 refuses. */
int decode_stack_ids(const struct dmodel *m, const float *embed, int64_t es, int64_t vocab, const int64_t *ids,
                     const int64_t *positions, const int64_t *slots, float *h, float *out, int64_t seq_len,
                     const int32_t *table, float *const *k_caches, float *const *v_caches, float *scratch,
                     int64_t scratch_len) {
    const int64_t tok = ids[0];
    if (tok < 0 || tok >= vocab) return 1;
    if (m->bf16) load_row(BF16, h, (const uint16_t *)embed + tok * es, m->hidden);
    else memcpy(h, embed + tok * es, (size_t)m->hidden * sizeof(float));
    if (m->emb_scale != 1.f)
        for (int i = 0; i < m->hidden; i++) h[i] = rb(m->bf16, h[i] * m->emb_scale);
    return decode_stack_f32(m, h, out, positions[0], slots[0], seq_len, table, k_caches, v_caches, scratch,
                            scratch_len);
}
