/* GGUF weight blocks (ggml's layouts), shared by the quantized CPU kernels: quant_matmul_cpu.c,
 * quant_dot_cpu.c and decode_stack_cpu.c. Byte j of a Q4 block's nibbles holds element j (low
 * nibble) and element j + 16 (high nibble).
 *   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
 *   Q8_0 (34 bytes): f16 d, 32 int8; w = d * q
 */
#ifndef MOEBUS_GGUF_BLOCKS_H
#define MOEBUS_GGUF_BLOCKS_H
#include <limits.h>

#include "cpu_common.h"
#include "cpu_dot.h" /* MOEBUS_DOT_AVX2 and <immintrin.h> */

enum qtype { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml's type ids */

#define QK 32  /* weights per block */
#define RMAX 4 /* x rows sharing one loaded weight block on the few-row paths */

/* How far ahead of its current block a GEMV asks for its weight row stream (the rows of a call are
 * contiguous). A core's own misses and the hardware prefetcher kept one Sapphire Rapids VM core at
 * ~4.5 ns a Q8_0 block on a 30 MB weight, ~2x its in-cache time; 4 KB ahead: 1.7-2.0 ns (2 KB:
 * 2.2-2.5, 1 KB: 2.9-3.2). Cheap: one hint per two blocks, never a fault past the end. */
#define PREFETCH_BYTES 4096

INLINE void prefetch_ahead(const uint8_t *p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

INLINE int block_bytes(int qt) { return qt == Q4_0 ? 18 : qt == Q4_1 ? 20 : 34; }

INLINE int known_qtype(int qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q8_0; }

INLINE int bad_k(int64_t K) { return K % QK != 0 || K <= 0 || K >= INT_MAX / 2; }

INLINE float half_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* The 32 weights of one block as float32 (the reference's arithmetic). */
INLINE void dequant_block(int qt, const uint8_t *b, float *o) {
    const float d = half_at(b);
    if (qt == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
        return;
    }
    const uint8_t *q = b + (qt == Q4_1 ? 4 : 2);
    if (qt == Q4_1) {
        const float m = half_at(b + 2);
        for (int j = 0; j < QK / 2; j++) o[j] = d * (float)(q[j] & 15) + m, o[j + 16] = d * (float)(q[j] >> 4) + m;
    } else {
        for (int j = 0; j < QK / 2; j++) o[j] = d * (float)((q[j] & 15) - 8), o[j + 16] = d * (float)((q[j] >> 4) - 8);
    }
}

#endif
