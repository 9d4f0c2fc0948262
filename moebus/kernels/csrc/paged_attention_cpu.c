/* Paged decode attention for CPUs: one query token per sequence, read straight from the paged
 * cache (no gather copy), float32 accumulation, online softmax over tiles of TILE positions.
 *
 * Layouts and semantics are those of kernels/paged_attention.py (its torch reference is the
 * spec): q [B, Hq, D], caches [N, bs, Hkv, D*] (last dim contiguous), block_tables [B, *] int32,
 * seq_lens [B] int32, optional sinks [Hq] float32, sliding window W > 0 keeps p >= len - W.
 * One task per sequence, all heads together: a cache slot's Hkv rows are adjacent, so a task
 * streams whole pages. The G = Hq / Hkv query heads of a kv head share each K/V row. With
 * AVX-512 (head dims multiple of 16) a tile runs per kv head: QK partials of 16 positions are
 * reduced together (bf16 on vdpbf16ps where there is AVX512-BF16), and for G <= 4 with Dv 64/128
 * the V accumulators stay in registers; AVX2 CPUs run the same tiles 8 lanes wide (head dims
 * multiple of 8; V accumulators in column chunks); elsewhere each row is converted to float32
 * once and dotted per head. bf16 with AMX (pages of a multiple of 16, tiles starting on a
 * 16-position boundary, Hkv * D / 32 <= 6) takes QK on tiles instead: see paged_attention_amx.h.
 * Each tile's slots are found once, and the next tile's (or, on a sequence's last tile, the first
 * of the sequence the thread runs next) are prefetched.
 */
#include "paged_decode.h"

#define CHUNK 4 /* sequences a thread takes at a time */

#define DECODE_ONE(DT, ES, DD, DDV)                                                                                    \
    decode_one(DT, ES, qb, q_sh, kc, k_sn, k_ss, k_sh, vc, v_sn, v_ss, v_sh, bt + b * bt_sb, seq_lens[b], nt, nl, \
               sinks, ob, o_sh, Hq, Hkv, DD, DDV, bs, window, scale, amx)

/* Returns 0 on success, 1 when a shape is outside the kernel's limits (caller falls back). */
#define DEFINE_PAGED_DECODE(NAME, DT, ES)                                                             \
    int NAME(const void *q, int64_t q_sb, int64_t q_sh, const void *kc, int64_t k_sn, int64_t k_ss, \
             int64_t k_sh, const void *vc, int64_t v_sn, int64_t v_ss, int64_t v_sh,               \
             const int32_t *bt, int64_t bt_sb, const int32_t *seq_lens, const float *sinks,         \
             void *out, int64_t o_sb, int64_t o_sh, int B, int Hq, int Hkv, int D, int Dv, int bs,  \
             int window, float scale) {                                                              \
        if (Hq > MAXHQ || D > MAXD || Dv > MAXD || Hq % Hkv) return 1;                              \
        const int amx = amx_applies(DT, Hq, Hkv, D, bs);                                            \
        _Pragma("omp parallel if (B > 1)") {                                                         \
            if (amx) amx_configure(Hq, Hkv * D / 32);                                                \
            /* chunks of CHUNK sequences: a thread knows the one it runs next */                     \
            _Pragma("omp for schedule(dynamic, CHUNK)") for (int b = 0; b < B; b++) {               \
                const char *qb = (const char *)q + b * q_sb * ES;                                       \
                const int nl = (b + 1) % CHUNK && b + 1 < B ? seq_lens[b + 1] : 0;                       \
                const int32_t *nt = bt + (nl ? b + 1 : b) * bt_sb;                                       \
                char *ob = (char *)out + b * o_sb * ES;                                                  \
                /* constant head dims let the compiler unroll the row loops fully (~1.5x) */            \
                if (D == 64 && Dv == 64)                                                                 \
                    DECODE_ONE(DT, ES, 64, 64);                                                                \
                else if (D == 128 && Dv == 128)                                                          \
                    DECODE_ONE(DT, ES, 128, 128);                                                              \
                else                                                                                     \
                    DECODE_ONE(DT, ES, D, Dv);                                                                 \
            }                                                                                            \
            /* the tile state handed back: context switches then need not save it */                     \
            if (amx) _tile_release();                                                                    \
        }                                                                                                \
        return 0;                                                                                    \
    }

DEFINE_PAGED_DECODE(paged_decode_f32, F32, 4)
DEFINE_PAGED_DECODE(paged_decode_bf16, BF16, 2)
DEFINE_PAGED_DECODE(paged_decode_f16, F16, 2)
