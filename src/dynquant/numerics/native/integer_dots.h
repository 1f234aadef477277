/* Shared by the integer-activation products (packed_matvec_q8.c: int8, packed_matvec_q16.c:
 * int16, packed_experts_integer.c: their expert pairs): the token's quantization, the codes'
 * unpacking into integer lanes, the jobs. packed_matvec_q8.c's header defines the arithmetic. */
#ifndef DQ_INTEGER_DOTS_H
#define DQ_INTEGER_DOTS_H
#include <float.h>
#include <math.h>

#include "pool.h"
#include "unpack.h"

#define Q8_BLOCK 32
/* Blocks whose largest |x| is below this quantize to zeros (127 / amax would overflow). */
#define Q8_TINY 1e-30f

#if defined(__AVX2__)
#include <immintrin.h>
#define Q8_AVX2 1
#if defined(__AVXVNNI__)
#define Q8_VNNI 1
#define Q8_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#define Q8_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define Q8_DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#define Q8_DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#else /* acc + vpmaddwd: the same integers (vpdpwssd wraps as the add does) in two operations */
#define Q8_DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif
#endif

/* A block's step d = amax / levels and *inv = levels / amax, which quantizes it (both 0 for a
 * block whose largest |x| is below Q8_TINY: it quantizes to zeros). The largest |x| ignores NaN
 * as fmaxf would, which without -ffinite-math-only is a library call per value, in a loop that
 * every decode product runs (AVX2: vmaxps, which keeps its second operand beside a NaN). */
static inline float block_step(const float *x, int64_t n, float levels, float *inv) {
    float amax = 0.0f;
    int64_t j = 0;
#ifdef Q8_AVX2
    __m256 m = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + j)), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
    for (; j < n; j++) {
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    const int live = amax >= Q8_TINY;
    *inv = live ? levels / amax : 0.0f;
    return live ? amax / levels : 0.0f;
}

#ifdef Q8_AVX2
/* 8 values of x times inv, each to the nearest integer (ties to even: the rounding mode's, as
 * nearbyintf), NaN to 0 (as the scalar conversion leaves it). */
static inline __m256i round_scaled8(const float *x, __m256 inv) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), inv);
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_and_ps(r, _mm256_cmp_ps(v, v, _CMP_ORD_Q)));
}
#endif

/* xq[j] = nearest of x[j] * inv for j < n (|x * inv| <= 32767 by the step): int16, or int8
 * where xq8 is given. */
static inline void round_scaled(const float *x, int64_t n, float inv, int16_t *xq16,
                                int8_t *xq8) {
    int64_t j = 0;
#ifdef Q8_AVX2
    const __m256 iv = _mm256_set1_ps(inv);
    for (; j + 32 <= n; j += 32) {
        const __m256i a = _mm256_packs_epi32(round_scaled8(x + j, iv), round_scaled8(x + j + 8, iv));
        const __m256i b = _mm256_packs_epi32(round_scaled8(x + j + 16, iv),
                                             round_scaled8(x + j + 24, iv));
        if (xq8) { /* packs work in 128-bit halves: the dwords back in order */
            const __m256i c = _mm256_packs_epi16(a, b);
            _mm256_storeu_si256((__m256i *)(xq8 + j),
                                _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        } else {
            _mm256_storeu_si256((__m256i *)(xq16 + j), _mm256_permute4x64_epi64(a, 0xD8));
            _mm256_storeu_si256((__m256i *)(xq16 + j + 16), _mm256_permute4x64_epi64(b, 0xD8));
        }
    }
#endif
    for (; j < n; j++) {
        const float v = nearbyintf(x[j] * inv);
        if (xq8) xq8[j] = (int8_t)v; else xq16[j] = (int16_t)v;
    }
}

/* A token's values in blocks of Q8_BLOCK, each block's bytes put in `order` (unit: `size` bytes,
 * value p of a block from value order[p]); out may be x. One loop for int8 and int16 tokens. */
static inline void permute_blocks(const void *x, int64_t n, const int *order, int size,
                                  void *out) {
    uint8_t block[Q8_BLOCK * sizeof(int16_t)];
    const int block_bytes = Q8_BLOCK * size;
    for (int64_t b = 0; b < n * size; b += block_bytes) {
        memcpy(block, (const uint8_t *)x + b, (size_t)block_bytes);
        for (int p = 0; p < Q8_BLOCK; p++)
            memcpy((uint8_t *)out + b + p * size, block + order[p] * size, (size_t)size);
    }
}

/* A block's 32 codes as bytes, in order (plain C; unit k: 8 codes in `bits` bytes). */
static inline void block_codes(const uint8_t *bytes, int bits, uint8_t *c) {
    if (bits == 8) {
        memcpy(c, bytes, Q8_BLOCK);
        return;
    }
    for (int k = 0; k < Q8_BLOCK / 8; k++) {
        uint64_t u = 0;
        for (int b = 0; b < bits; b++) u |= (uint64_t)bytes[k * bits + b] << (8 * b);
        for (int i = 0; i < 8; i++) c[8 * k + i] = (uint8_t)((u >> (i * bits)) & ((1u << bits) - 1));
    }
}

#ifdef Q8_AVX2
/* The vpshufb indices and vpsrlvd counts that put 16 codes of `bits` bits (3, 5, 6) in 16-bit
 * lanes: code j and code j + 8 start at the same bit of their bytes (8 codes fill `bits` bytes),
 * so one 32-bit lane holds both codes' two bytes (j's in its low half, j + 8's in its high half)
 * and one variable shift puts both at their half's bit 0; a mask clears the rest. No multiply
 * (on AMD Zen the vector multiplier is one pipe, which the dot products need). Register r, lane
 * half h, 32-bit lane i of the half: codes 16h + 4r + i and that + 8; half h of the source
 * register holds the block's bytes from 2 * bits * h. */
typedef struct {
    __m256i shuffle_lo, shuffle_hi, shift_lo, shift_hi;
    __m256i mask_lo, mask_hi; /* each half's code mask shifted to its code's bit (shift_*) */
    int bits;
} q8_unpacker;

static inline q8_unpacker make_q8_unpacker(int bits) {
    int8_t shuf[2][32];
    int32_t shift[2][8];
    for (int r = 0; r < 2; r++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) {
                const int code = 4 * r + i; /* and code + 8, in the half's bytes */
                /* both halves read one 16-byte window broadcast for 2-4 bits (q8_window) */
                const int first = code * bits / 8 + (bits <= 4 ? 2 * bits * h : 0);
                int8_t *lane = shuf[r] + 16 * h + 4 * i;
                lane[0] = (int8_t)first;
                lane[1] = (int8_t)(first + 1);
                lane[2] = (int8_t)(first + bits);
                lane[3] = (int8_t)(first + bits + 1);
                shift[r][4 * h + i] = code * bits % 8;
            }
    q8_unpacker u = {_mm256_loadu_si256((const __m256i *)shuf[0]),
                     _mm256_loadu_si256((const __m256i *)shuf[1]),
                     _mm256_loadu_si256((const __m256i *)shift[0]),
                     _mm256_loadu_si256((const __m256i *)shift[1]),
                     _mm256_setzero_si256(), _mm256_setzero_si256(), bits};
    /* shifts are below 8, so a half's mask shifted stays in its half */
    const __m256i masks = _mm256_set1_epi32((int32_t)(0x10001u * ((1u << bits) - 1)));
    u.mask_lo = _mm256_sllv_epi32(masks, u.shift_lo);
    u.mask_hi = _mm256_sllv_epi32(masks, u.shift_hi);
    return u;
}

/* How far ahead a row pair prefetches its codes: eight rows, at least DQ_PREFETCH_BYTES and at
 * most DQ_PAIR_PREFETCH_BYTES, or two rows where those are longer (7.1 KB a row for a 3-bit
 * 18,944-wide down projection: the pair's stream then jumps two rows at its end, and a prefetch
 * at the same place two rows on is where it will read next; without it, the second row of each
 * next pair started unprefetched: 3-bit int16 products on such rows 14-17 -> 18-19 GB/s, SPR).
 * Eight rows: on AMD Zen 5 (BENCHMARKS.md, "Memory bandwidth") 4 KiB left 4-bit rows of 2,048-
 * 4,096 codes well under the memory's rate and 8-12 KiB brought them near it, while 12 KiB
 * slowed rows of 576 codes (288 bytes), for which 4 KiB is already eight rows. Never past the
 * part's last row (`rows_after` rows follow the pair in it). */
#define DQ_PAIR_PREFETCH_BYTES 12288
static inline int64_t prefetch_ahead(int64_t row_bytes, int64_t rows_after) {
    int64_t ahead = 8 * row_bytes;
    ahead = ahead < DQ_PREFETCH_BYTES ? DQ_PREFETCH_BYTES : ahead;
    ahead = ahead > DQ_PAIR_PREFETCH_BYTES ? DQ_PAIR_PREFETCH_BYTES : ahead;
    ahead = ahead < 2 * row_bytes ? 2 * row_bytes : ahead;
    const int64_t left = rows_after > 0 ? rows_after * row_bytes : 0;
    return ahead < left ? ahead : left;
}

/* The first bytes of a part's codes, up to where its row pairs' prefetches start (prefetch_ahead
 * for the first pair): else they wait on memory, up to 12 KiB a part, which on a small model's
 * matrices (parts of ~200 KB) cost ~10%. */
static inline void prefetch_part_start(const uint32_t *qweight, int64_t lo, int64_t hi,
                                       int64_t row_bytes) {
    const uint8_t *start = (const uint8_t *)qweight + lo * row_bytes;
    const int64_t n = prefetch_ahead(row_bytes, hi - lo);
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(start + b, 0, 3);
}

/* A row pair's group g starting at b0 (and b1, the second row's, where `two`): on the part's last
 * group (`last`) the row read last is pointed at a zero-padded copy in `spare` (the SIMD loads
 * pass a group's end); then both prefetched `ahead` bytes on. */
static inline __attribute__((always_inline)) void start_group_pair(
    const uint8_t **b0, const uint8_t **b1, int two, int last, int64_t nbytes, uint8_t *spare,
    int64_t ahead) {
    if (last) {
        memset(spare, 0, (size_t)nbytes + 32);
        memcpy(spare, two ? *b1 : *b0, (size_t)nbytes);
        if (two) *b1 = spare; else *b0 = spare;
    }
    prefetch_codes_at(*b0, ahead);
    if (two) prefetch_codes_at(*b1, ahead);
}

/* A 4-bit block's 16 bytes in both lane halves, the upper half shifted right by a nibble: a
 * broadcast load and one variable shift (no cross-lane insert, which costs a shuffle pipe). */
static inline __m256i nibble_halves(const uint8_t *p) {
    return _mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                             _mm256_setr_epi64x(0, 0, 4, 4));
}

/* A block's bytes in both lane halves: for 2-4 bits one 16-byte window broadcast from memory (a
 * load, no cross-lane shuffle), else the half from p and the half from p + 2 * bits. Reads up to
 * 16 bytes past a block's start + 2 * bits. */
static inline __m256i q8_window(const uint8_t *p, int bits) {
    if (bits <= 4) return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)(p + 2 * bits)), 1);
}

/* 32 codes of 3, 5 or 6 bits at p as 16-bit lanes in two registers (q8_unpacker's order). Reads
 * past the block (q8_window): callers give a padded copy for a matrix's last. */
static inline __attribute__((always_inline)) void unpack32_words(
    const uint8_t *p, int bits, const q8_unpacker *u, __m256i *lo, __m256i *hi) {
    const __m256i v = q8_window(p, bits);
    const __m256i mask = _mm256_set1_epi16((int16_t)((1 << bits) - 1));
    *lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, u->shuffle_lo), u->shift_lo), mask);
    *hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, u->shuffle_hi), u->shift_hi), mask);
}

/* The same 32 codes as bytes (vpackuswb of the two registers: lane half h lists register 0's
 * eight codes of the half, then register 1's). */
static inline __attribute__((always_inline)) __m256i unpack32_avx2(const uint8_t *p, int bits,
                                                                    const q8_unpacker *u) {
    __m256i lo, hi;
    unpack32_words(p, bits, u, &lo, &hi);
    return _mm256_packus_epi16(lo, hi);
}
#endif

#ifdef Q8_AVX2
/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)): lane_sum's last three levels. */
static inline float lane_sum8(__m256 acc) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 t = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

static inline float lane_sum8_portable(const float *a) {
    float s4[4];
    for (int l = 0; l < 4; l++) s4[l] = a[l] + a[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Quantized tokens: xq [m, padded_n] and d [m, blocks] (as dq_q8_quantize), xsum [m, groups]
 * (as q8_quantize_ordered). */
typedef struct {
    const int8_t *xq;
    const float *d, *xsum;
} q8_tokens;

typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t padded_n, gs;
    int bits, portable;
    q8_tokens x;
    int64_t m;
    float *y;
    int64_t y_stride;
    int32_t *dots; /* dq_q8_group_dots: the per-group integer sums instead of y (one token) */
} q8_job;

typedef struct {
    /* [m, padded_n]: each block in q16_code's order, or where `split` each group's values as
     * their high bytes (int8) then their low bytes (uint8), in order (q16_split_group) */
    const int16_t *xq;
    const float *d, *xsum; /* [m, groups] each */
    int split;
} q16_tokens;

typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t padded_n, gs;
    int bits, portable;
    q16_tokens x;
    int64_t m;
    float *y;
    int64_t y_stride;
    int32_t *dots; /* dq_q16_group_dots: the per-group integer sums instead of y (one token) */
} q16_job;

/* The products' parts (pool.c ranges of rows), the tokens' quantization (one allocation owned
 * by the result's d; NULL if out of memory) and the layouts each serves: internal to the
 * library. */
__attribute__((visibility("hidden"))) int q8_rows(const void *ctx, int64_t lo, int64_t hi);
__attribute__((visibility("hidden"))) q8_tokens q8_quantize_tokens(const float *x, int64_t m, int64_t padded_n,
                                                       int64_t gs, int bits);
__attribute__((visibility("hidden"))) int q8_supported(int64_t gs, int bits);
__attribute__((visibility("hidden"))) int q16_rows(const void *ctx, int64_t lo, int64_t hi);
__attribute__((visibility("hidden"))) q16_tokens q16_quantize_tokens(const float *x, int64_t m, int64_t padded_n,
                                                         int64_t gs, int bits, int portable);
__attribute__((visibility("hidden"))) int q16_supported(int64_t gs, int bits);
#endif
