/* One token times a packed matrix with int8 activations: integer dot products on the codes.
 *
 * The format's groups are asymmetric, w = q * scale + offset, so over a group
 *   x . w = scale * (q . x) + offset * sum(x).
 * The token is quantized once per call to int8 in blocks of 32 (xq = round(x * 127 / amax),
 * d = amax / 127, as llama.cpp's Q8 blocks), and q . x over a block becomes an exact integer dot
 * product of unsigned codes with signed bytes: vpdpbusd where AVX-VNNI or AVX512-VNNI exist,
 * vpmaddubsw + vpmaddwd on AVX2, plain C elsewhere. The offsets' part keeps the float sums of x.
 *
 * The result is defined, for every build, as:
 *   lane l (0..7) of block b: the int32 sum over positions p = 4l .. 4l+3 of
 *     codes[o(p)] * xq[o(p)], o the width's order of a block's 32 codes (exact):
 *     4 bits: o(p) = 2p, then 2(p - 16) + 1 (the low nibbles of the block's 16 bytes, then the
 *     high ones); 2 bits: o(p) = 4 (p % 8) + p / 8 (each byte's codes at one shift, byte by
 *     byte, shift after shift); 8 bits: o(p) = p; 3, 5 and 6 bits: with h = p / 16,
 *     r = (p % 16) / 8 and l = p % 8, o(p) = 16h + 4r + l / 2 + 8 (l % 2) (the 16-bit lanes
 *     of unpack32_words packed to bytes);
 *   group g: gacc[l] = sum over its blocks, in order, of d[b] * float(lane l)   (mul, then add);
 *   row:     acc[l] = sum over groups, in order, of scale[g] * gacc[l];
 *            y = ((acc0+acc4)+(acc2+acc6)) + ((acc1+acc5)+(acc3+acc7)) + sum_g offset[g] * xsum[g]
 * with xsum[g] the sum over the group's blocks, in order, of d[b] * float(sum of the block's xq)
 * (mul, then add): the offsets multiply the same quantized token as the codes, so the product is
 * exactly w . x^ for the dequantized token x^ and its error w . (x^ - x) is small where the
 * weights are centred (with the float sums of x instead it would be scale * q . (x^ - x),
 * uncentred codes: ~3x larger). Integer lanes are exact in every path and the
 * float operations are the same in the same order, so every build gives the same bits
 * (numerics/packed_matvec.py holds them to a torch reference of exactly these operations).
 *
 * Unpacking 32 codes into 32 bytes (AVX2): 4 and 2 bits in the order o above, where a mask and a
 * shift (4 bits: of the block's 16 bytes; 2 bits: of its 8 bytes broadcast, one shift a qword)
 * put every code in place, the token's int8 values permuted to match once per call. 3, 5 and 6
 * bits: the two bytes of codes j and j + 8 (which start at the same bit) into one 32-bit lane
 * (vpshufb), one variable shift (vpsrlvd) and a mask, then the two registers packed
 * (vpackuswb). No gather, no cross-lane permute, no multiply in the loop. 8-bit codes are the bytes
 * themselves; without VNNI they are split in nibbles (vpmaddubsw saturates past 16 bits).
 */
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
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define Q8_DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#endif
#endif

/* 2: VNNI dot products, 1: AVX2, 0: portable only. */
int dq_q8_simd(void) {
#if defined(Q8_VNNI)
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}

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

/* x [padded_n] -> xq [padded_n] int8 and d [padded_n / 32]: per block of 32, d = amax / 127,
 * xq = nearest (ties to even) of x * (127 / amax). */
void dq_q8_quantize(const float *x, int64_t padded_n, int8_t *xq, float *d) {
    for (int64_t b = 0; b < padded_n / Q8_BLOCK; b++) {
        const float *xb = x + b * Q8_BLOCK;
        float inv;
        d[b] = block_step(xb, Q8_BLOCK, 127.0f, &inv);
        round_scaled(xb, Q8_BLOCK, inv, NULL, xq + b * Q8_BLOCK);
    }
}

/* o(p): which code of a block sits at position p in a width's order (the header). */
static inline int q8_order(int bits, int p) {
    if (bits == 4) return p < 16 ? 2 * p : 2 * (p - 16) + 1;
    if (bits == 2) return 4 * (p % 8) + p / 8;
    if (bits == 8) return p;
    const int l = p % 8; /* 3, 5, 6 bits: lane half p / 16, register (p % 16) / 8 */
    return 16 * (p / 16) + 4 * ((p % 16) / 8) + l / 2 + 8 * (l % 2);
}

/* A token's values in blocks of Q8_BLOCK, each block's bytes put in `order` (unit: `size` bytes,
 * value p of a block from value order[p]); out may be x. One loop for int8 and int16 tokens. */
static void permute_blocks(const void *x, int64_t n, const int *order, int size, void *out) {
    uint8_t block[Q8_BLOCK * sizeof(int16_t)];
    const int block_bytes = Q8_BLOCK * size;
    for (int64_t b = 0; b < n * size; b += block_bytes) {
        memcpy(block, (const uint8_t *)x + b, (size_t)block_bytes);
        for (int p = 0; p < Q8_BLOCK; p++)
            memcpy((uint8_t *)out + b + p * size, block + order[p] * size, (size_t)size);
    }
}

/* xq [n] in natural order -> out [n] in the width's order, block by block (out may be xq). */
static void q8_permute(const int8_t *xq, int64_t n, int bits, int8_t *out) {
    int order[Q8_BLOCK];
    for (int p = 0; p < Q8_BLOCK; p++) order[p] = q8_order(bits, p);
    permute_blocks(xq, n, order, 1, out);
}

static inline int q8_permutes(int bits) { return bits != 8; }

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

/* The offsets' sums of an int8 token (the header's xsum): per group of gs, the sum over its
 * blocks in order of d[b] * float(the block's integer sum). */
static void quantized_group_sums(const int8_t *xq, const float *d, int64_t n, int64_t gs,
                                 float *xsum) {
    for (int64_t g = 0; g < n / gs; g++) {
        float s = 0.0f;
        for (int64_t b = g * gs / Q8_BLOCK; b < (g + 1) * gs / Q8_BLOCK; b++) {
            int32_t isum = 0;
            for (int64_t j = b * Q8_BLOCK; j < (b + 1) * Q8_BLOCK; j++) isum += xq[j];
            s += d[b] * (float)isum;
        }
        xsum[g] = s;
    }
}

/* The 8 integer lanes of one block, plain C, xq in the width's order: lane l sums positions
 * 4l .. 4l+3. */
static inline void block_lanes_portable(const uint8_t *bytes, int bits, const int8_t *xq,
                                        int32_t *lanes) {
    uint8_t c[Q8_BLOCK];
    block_codes(bytes, bits, c);
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int i = 0; i < 4; i++) s += (int32_t)c[q8_order(bits, 4 * l + i)] * xq[4 * l + i];
        lanes[l] = s;
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
    int bits;
} q8_unpacker;

static q8_unpacker make_q8_unpacker(int bits) {
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
                     _mm256_loadu_si256((const __m256i *)shift[1]), bits};
    return u;
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

/* 32 codes of 4 bits (16 bytes at p) in the order o: low nibbles, then high ones. */
static inline __m256i unpack32_4bit(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* 32 codes of 2 bits (8 bytes at p) in the order o: qword q holds every byte's code at shift 2q. */
static inline __m256i unpack32_2bit(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    const __m256i shifted = _mm256_srlv_epi64(_mm256_set1_epi64x(v), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x03));
}

/* The 8 integer lanes of unsigned codes c times signed xq (lane l: bytes 4l .. 4l+3); codes
 * below 64 (vpmaddubsw's pair sums stay below 2^15). */
static inline __m256i dot_small_codes(__m256i c, __m256i xq) {
#ifdef Q8_VNNI
    return Q8_DPBUSD(_mm256_setzero_si256(), c, xq);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, xq), _mm256_set1_epi16(1));
#endif
}

static inline __m256i dot_bytes(__m256i c, __m256i xq) {
#ifdef Q8_VNNI
    return Q8_DPBUSD(_mm256_setzero_si256(), c, xq);
#else
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = dot_small_codes(_mm256_and_si256(c, nibble), xq);
    const __m256i hi = dot_small_codes(_mm256_and_si256(_mm256_srli_epi16(c, 4), nibble), xq);
    return _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo);
#endif
}

/* A block's 32 codes as bytes in the width's order (`bits` a constant where it is inlined: the
 * width's branches fold away). */
static inline __attribute__((always_inline)) __m256i unpack_block(const uint8_t *bytes, int bits,
                                                                  const q8_unpacker *u) {
    if (bits == 4) return unpack32_4bit(bytes);
    if (bits == 2) return unpack32_2bit(bytes);
    return unpack32_avx2(bytes, bits, u);
}

static inline __m256i block_lanes_avx2(const uint8_t *bytes, const int8_t *xq,
                                       const q8_unpacker *u) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (u->bits == 8) return dot_bytes(_mm256_loadu_si256((const __m256i *)bytes), x);
    return dot_small_codes(unpack_block(bytes, u->bits, u), x);
}

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

static int q8_rows_portable(const q8_job *j, const int8_t *xq, const float *d,
                            const float *xsum, float *y, int64_t lo, int64_t hi) {
    const int64_t groups = j->padded_n / j->gs, blocks = j->gs / Q8_BLOCK;
    const int64_t block_bytes = Q8_BLOCK * j->bits / 8;
    for (int64_t r = lo; r < hi; r++) {
        const uint8_t *row = (const uint8_t *)j->qweight + r * groups * (j->gs * j->bits / 8);
        float acc[8] = {0};
        float o_sum = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float gacc[8] = {0};
            int32_t total = 0;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t k = g * blocks + b;
                int32_t lanes[8];
                block_lanes_portable(row + k * block_bytes, j->bits, xq + k * Q8_BLOCK, lanes);
                for (int l = 0; l < 8; l++) {
                    gacc[l] += d[k] * (float)lanes[l];
                    total += lanes[l];
                }
            }
            if (j->dots) {
                j->dots[r * groups + g] = total;
                continue;
            }
            const float s = bf16_value(j->scales[r * groups + g]);
            for (int l = 0; l < 8; l++) acc[l] += s * gacc[l];
            o_sum += bf16_value(j->offsets[r * groups + g]) * xsum[g];
        }
        if (!j->dots) y[r] = lane_sum8_portable(acc) + o_sum;
    }
    return 0;
}

#ifdef Q8_AVX2
/* One block's lanes scaled by its d and added to a group's running lanes (mul, then add). */
static inline __m256 add_block(__m256 gacc, __m256i lanes, __m256 d) {
    return _mm256_add_ps(gacc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes)));
}

/* A row's result from its 8 lanes and its offsets' part: the group loop's epilogue. */
static inline void add_group(__m256 *acc, __m256 gacc, uint16_t scale) {
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_set1_ps(bf16_value(scale)), gacc));
}

/* Rows r .. r + rows_n - 1 (one or two) with `bits` a constant after inlining. Two rows at a
 * time share the token's loads and give the out-of-order core two independent chains of adds;
 * each row's operations are the same as alone. `tail`: the last row of the part, whose last
 * group is read from a padded copy (the SIMD loads pass a group's end). */
static inline __attribute__((always_inline)) void q8_row_pair(
    const q8_job *j, const int8_t *xq, const float *d, const float *xsum, float *y, int64_t r,
    int two, int tail, int bits, const q8_unpacker *u, uint8_t *spare) {
    const int64_t groups = j->padded_n / j->gs, blocks = j->gs / Q8_BLOCK;
    const int64_t block_bytes = Q8_BLOCK * bits / 8, group_nbytes = j->gs * bits / 8;
    const uint8_t *row0 = (const uint8_t *)j->qweight + r * groups * group_nbytes;
    const uint8_t *row1 = row0 + groups * group_nbytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float o0 = 0.0f, o1 = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b0 = row0 + g * group_nbytes, *b1 = row1 + g * group_nbytes;
        if (tail && g == groups - 1) {
            memset(spare, 0, (size_t)group_nbytes + 32);
            memcpy(spare, two ? b1 : b0, (size_t)group_nbytes);
            if (two) b1 = spare; else b0 = spare;
        }
        prefetch_codes(b0);
        if (two) prefetch_codes(b1);
        __m256 g0 = _mm256_setzero_ps(), g1 = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t k = g * blocks + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + k * Q8_BLOCK));
            const __m256 dk = _mm256_set1_ps(d[k]);
            if (bits == 8) {
                g0 = add_block(g0, dot_bytes(_mm256_loadu_si256((const __m256i *)(b0 + b * block_bytes)), x), dk);
                if (two) g1 = add_block(g1, dot_bytes(_mm256_loadu_si256((const __m256i *)(b1 + b * block_bytes)), x), dk);
            } else {
                g0 = add_block(g0, dot_small_codes(unpack_block(b0 + b * block_bytes, bits, u), x), dk);
                if (two) g1 = add_block(g1, dot_small_codes(unpack_block(b1 + b * block_bytes, bits, u), x), dk);
            }
        }
        add_group(&acc0, g0, j->scales[r * groups + g]);
        o0 += bf16_value(j->offsets[r * groups + g]) * xsum[g];
        if (two) {
            add_group(&acc1, g1, j->scales[(r + 1) * groups + g]);
            o1 += bf16_value(j->offsets[(r + 1) * groups + g]) * xsum[g];
        }
    }
    y[r] = lane_sum8(acc0) + o0;
    if (two) y[r + 1] = lane_sum8(acc1) + o1;
}

static inline __attribute__((always_inline)) void q8_rows_bits(
    const q8_job *j, const int8_t *xq, const float *d, const float *xsum, float *y, int64_t lo,
    int64_t hi, int bits) {
    const q8_unpacker u = make_q8_unpacker(bits);
    uint8_t spare[MAX_GROUP + 32];
    int64_t r = lo;
    for (; r + 2 < hi; r += 2) q8_row_pair(j, xq, d, xsum, y, r, 1, 0, bits, &u, spare);
    if (r + 2 == hi)
        q8_row_pair(j, xq, d, xsum, y, r, 1, 1, bits, &u, spare);
    else if (r < hi)
        q8_row_pair(j, xq, d, xsum, y, r, 0, 1, bits, &u, spare);
}

static void q8_rows_avx2(const q8_job *j, const int8_t *xq, const float *d, const float *xsum,
                         float *y, int64_t lo, int64_t hi) {
    switch (j->bits) { /* constant widths: shifts, loads and the 8-bit test fold away */
    case 2: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 2); break;
    case 3: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 3); break;
    case 4: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 4); break;
    case 5: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 5); break;
    case 6: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 6); break;
    default: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 8); break;
    }
}

/* dq_q8_group_dots' SIMD path: each group's lanes summed as integers. */
static void q8_dots_avx2(const q8_job *j, const int8_t *xq, int64_t lo, int64_t hi) {
    const int64_t groups = j->padded_n / j->gs, blocks = j->gs / Q8_BLOCK;
    const int64_t block_bytes = Q8_BLOCK * j->bits / 8, group_nbytes = j->gs * j->bits / 8;
    const q8_unpacker u = make_q8_unpacker(j->bits);
    uint8_t spare[MAX_GROUP + 32];
    for (int64_t r = lo; r < hi; r++)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = (const uint8_t *)j->qweight + (r * groups + g) * group_nbytes;
            if (r == hi - 1 && g == groups - 1) {
                memset(spare, 0, (size_t)group_nbytes + 32);
                memcpy(spare, bytes, (size_t)group_nbytes);
                bytes = spare;
            }
            __m256i total = _mm256_setzero_si256();
            for (int64_t b = 0; b < blocks; b++)
                total = _mm256_add_epi32(total, block_lanes_avx2(bytes + b * block_bytes,
                                                                 xq + (g * blocks + b) * Q8_BLOCK,
                                                                 &u));
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, total);
            j->dots[r * groups + g] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
        }
}
#endif

/* Rows [lo, hi) for every token, token after token (each reads the rows' codes again: a few
 * tokens' codes stay in cache). */
static int q8_rows(const void *ctx, int64_t lo, int64_t hi) {
    const q8_job *j = ctx;
    const int64_t blocks = j->padded_n / Q8_BLOCK, groups = j->padded_n / j->gs;
    for (int64_t t = 0; t < j->m; t++) {
        const int8_t *xq = j->x.xq + t * j->padded_n;
        const float *d = j->x.d + t * blocks, *xsum = j->x.xsum ? j->x.xsum + t * groups : NULL;
        float *y = j->y ? j->y + t * j->y_stride : NULL;
#ifdef Q8_AVX2
        if (!j->portable) {
            if (j->dots)
                q8_dots_avx2(j, xq, lo, hi);
            else
                q8_rows_avx2(j, xq, d, xsum, y, lo, hi);
            continue;
        }
#endif
        q8_rows_portable(j, xq, d, xsum, y, lo, hi);
    }
    return 0;
}

/* dq_q8_quantize, xsum [n / gs] (the header's), then the width's order (the header's o). */
static void q8_quantize_ordered(const float *x, int64_t n, int64_t gs, int bits, int8_t *xq,
                                float *d, float *xsum) {
    dq_q8_quantize(x, n, xq, d);
    quantized_group_sums(xq, d, n, gs, xsum);
    if (q8_permutes(bits)) q8_permute(xq, n, bits, xq);
}

/* m tokens x [m, padded_n] quantized (q8_quantize_ordered) into one allocation, owned by the
 * result's d (free it); d NULL if out of memory. */
static q8_tokens q8_quantize_tokens(const float *x, int64_t m, int64_t padded_n, int64_t gs,
                                    int bits) {
    const int64_t blocks = padded_n / Q8_BLOCK, groups = padded_n / gs;
    q8_tokens t = {0};
    float *d = malloc((size_t)(m * (blocks + groups)) * sizeof(float) + (size_t)(m * padded_n));
    if (!d) return t;
    int8_t *xq = (int8_t *)(d + m * (blocks + groups));
    for (int64_t i = 0; i < m; i++)
        q8_quantize_ordered(x + i * padded_n, padded_n, gs, bits, xq + i * padded_n,
                            d + i * blocks, d + m * blocks + i * groups);
    t.xq = xq;
    t.d = d;
    t.xsum = d + m * blocks;
    return t;
}

static int q8_supported(int64_t gs, int bits) {
    return gs % Q8_BLOCK == 0 && gs <= MAX_GROUP && bits >= 2 && bits <= 8 && bits != 7;
}

/* The per-(row, group) integer sums of codes * xq, the exact part of the product (for tests
 * against an int64 reference): dots [rows, groups]. */
int dq_q8_group_dots(const uint32_t *qweight, int64_t rows, int64_t padded_n, int64_t gs,
                     int bits, const int8_t *xq, int32_t *dots, int portable) {
    if (!q8_supported(gs, bits)) return -1;
    float *d = calloc((size_t)(padded_n / Q8_BLOCK), sizeof(float));
    int8_t *ordered = malloc((size_t)padded_n);
    int rc = -1;
    if (d && ordered) {
        q8_permute(xq, padded_n, bits, ordered);
        const q8_job j = {.qweight = qweight, .padded_n = padded_n, .gs = gs, .bits = bits,
                          .portable = portable, .x = {.xq = ordered, .d = d}, .m = 1,
                          .dots = dots};
        rc = q8_rows(&j, 0, rows);
    }
    free(d);
    free(ordered);
    return rc;
}

/* y [m, rows] (row stride y_stride) = x @ W^T for float32 tokens x [m, padded_n] (zero in the
 * padding), each quantized to int8 on its own; rows split over `threads` threads (pool.c). 0, or
 * -1 if out of memory or the group size / width is unsupported. */
int dq_matvec_q8_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                    int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                    int64_t m, float *y, int64_t y_stride, int portable, int threads) {
    q8_tokens tokens;
    if (!q8_supported(gs, bits) || !(tokens = q8_quantize_tokens(x, m, padded_n, gs, bits)).d)
        return -1;
    const q8_job j = {.qweight = qweight, .scales = scales, .offsets = offsets,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable,
                      .x = tokens, .m = m, .y = y, .y_stride = y_stride};
    const int rc = dq_parallel(q8_rows, &j, rows, threads);
    free((void *)tokens.d);
    return rc;
}

/* dq_matvec_q8_mt of one token with the block's fixed arguments prepared once (unpack.h,
 * dq_one_token). */
int dq_matvec_q8_one(const int64_t *a, const float *x, float *y) {
    return dq_one_token(dq_matvec_q8_mt, a, x, y);
}

/* ---- int16 activations ----
 * The same product with the token quantized to int16 per group of the layout (d[g] = amax / 32767
 * over the group's gs values): GPTQ's 2- and 3-bit codes carry a large error in directions the
 * calibration's activations do not use, and int8's noise reaches those directions
 * (BENCHMARKS.md, "Against llama.cpp"); at 16 bits that noise is ~100 times smaller. Widths 2-6.
 * A block's position p holds code q16_code(bits, p) (the 16-bit lanes the AVX2 unpacking leaves)
 * and lane l sums positions 2l, 2l+1, 16+2l and 17+2l (vpmaddwd on each half, then the halves
 * added). A group's lanes are summed over its blocks as integers (exact: codes < 64, |xq| <=
 * 32767, at most 128 products a lane for gs <= 1024), so the float work is once per group:
 *   acc[l] = acc[l] + (d[g] * scale[g]) * float(lane l)           (mul, mul, then add);
 *   y = ((acc0+acc4)+(acc2+acc6)) + ((acc1+acc5)+(acc3+acc7)) + sum_g offset[g] * xsum[g],
 * xsum[g] = d[g] * float(the group's integer sum of xq). */
#define Q16_LEVELS 32767.0f

/* Which code of a block sits at position p: register r = p / 16 of the unpacking (the
 * vpmaddwd of codes 0-15 or 16-31 of the positions), 16-bit lane i = p % 16 in it. 2 bits:
 * byte b = 2 (i % 4) + r of the block's 8, shifted by 2 (i / 4); 4 bits: byte b = 2 (i % 8) + r
 * of its 16, low nibble in the first 8 lanes, high in the rest; other widths: with l = i % 8,
 * code 16 (i / 8) + 4 r + l / 2 + 8 (l % 2) (unpack32_words' order). */
static inline int q16_code(int bits, int p) {
    const int r = p / 16, i = p % 16;
    if (bits == 2) return 4 * (2 * (i % 4) + r) + i / 4;
    if (bits == 4) return 2 * (2 * (i % 8) + r) + i / 8;
    return 16 * (i / 8) + 4 * r + (i % 8) / 2 + 8 * (i % 2);
}

/* x [n] -> xq [n] int16 (nearest, ties to even, of x * (32767 / amax) per group of gs), d
 * [n / gs]; natural order. */
void dq_q16_quantize(const float *x, int64_t n, int64_t gs, int16_t *xq, float *d) {
    for (int64_t g = 0; g < n / gs; g++) {
        const float *xg = x + g * gs;
        float inv;
        d[g] = block_step(xg, gs, Q16_LEVELS, &inv);
        round_scaled(xg, gs, inv, xq + g * gs, NULL);
    }
}

typedef struct {
    const int16_t *xq; /* [m, padded_n], each block in q16_code's order */
    const float *d, *xsum; /* [m, groups] each */
} q16_tokens;

/* The group sums of a token quantized per group (d one per group). */
static void q16_group_sums(const int16_t *xq, const float *d, int64_t n, int64_t gs,
                           float *xsum) {
    for (int64_t g = 0; g < n / gs; g++) {
        int32_t isum = 0;
        for (int64_t j = g * gs; j < (g + 1) * gs; j++) isum += xq[j];
        xsum[g] = d[g] * (float)isum;
    }
}

/* Each block of 32 of q [n] (natural order) into q16_code's order for `bits` (out may be q). */
static void q16_permute(const int16_t *q, int64_t n, int bits, int16_t *out) {
    int order[Q8_BLOCK];
    for (int p = 0; p < Q8_BLOCK; p++) order[p] = q16_code(bits, p);
    permute_blocks(q, n, order, (int)sizeof *q, out);
}

static q16_tokens q16_quantize_tokens(const float *x, int64_t m, int64_t padded_n, int64_t gs,
                                      int bits) {
    const int64_t groups = padded_n / gs;
    q16_tokens t = {0};
    float *d = malloc((size_t)(2 * m * groups) * sizeof(float) +
                      (size_t)(m * padded_n) * sizeof(int16_t));
    if (!d) return t;
    int16_t *xq = (int16_t *)(d + 2 * m * groups);
    float *xsum = d + m * groups;
    for (int64_t i = 0; i < m; i++) {
        int16_t *q = xq + i * padded_n;
        dq_q16_quantize(x + i * padded_n, padded_n, gs, q, d + i * groups);
        q16_group_sums(q, d + i * groups, padded_n, gs, xsum + i * groups);
        q16_permute(q, padded_n, bits, q);
    }
    t.xq = xq;
    t.d = d;
    t.xsum = xsum;
    return t;
}

static inline void q16_lanes_portable(const uint8_t *bytes, int bits, const int16_t *x,
                                      int32_t *lanes) {
    uint8_t c[Q8_BLOCK];
    block_codes(bytes, bits, c);
    for (int l = 0; l < 8; l++) {
        const int p[4] = {2 * l, 2 * l + 1, 16 + 2 * l, 17 + 2 * l};
        int32_t s = 0;
        for (int i = 0; i < 4; i++) s += (int32_t)c[q16_code(bits, p[i])] * x[p[i]];
        lanes[l] = s;
    }
}

#ifdef Q8_AVX2
/* A block's 32 codes in two registers of 16-bit lanes (q16_code's order): 2 and 4 bits by masks
 * and shifts of the bytes in place (2 bits: the 8 bytes broadcast, one shift a qword; 4 bits:
 * the 16 bytes, and shifted by a nibble), other widths by unpack32_words. */
static inline __attribute__((always_inline)) void q16_unpack(const uint8_t *p, int bits,
                                                             const q8_unpacker *u, __m256i *lo,
                                                             __m256i *hi) {
    if (bits == 2 || bits == 4) {
        __m256i v;
        if (bits == 2) {
            int64_t w;
            memcpy(&w, p, sizeof w);
            v = _mm256_srlv_epi64(_mm256_set1_epi64x(w), _mm256_setr_epi64x(0, 2, 4, 6));
        } else {
            const __m128i b = _mm_loadu_si128((const __m128i *)p);
            v = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
        }
        const __m256i mask = _mm256_set1_epi16((int16_t)((1 << bits) - 1));
        *lo = _mm256_and_si256(v, mask);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 8), mask);
        return;
    }
    unpack32_words(p, bits, u, lo, hi);
}

static inline __attribute__((always_inline)) __m256i q16_lanes_avx2(const uint8_t *p, int bits,
                                                                    const int16_t *x,
                                                                    const q8_unpacker *u) {
    __m256i lo, hi;
    q16_unpack(p, bits, u, &lo, &hi);
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}
#endif

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

/* A group's 8 integer lanes summed over its blocks: AVX2 or portable (the same integers). */
static inline void q16_group_lanes(const q16_job *j, const uint8_t *bytes, const int16_t *x,
                                   int32_t *lanes, const void *u) {
    const int64_t blocks = j->gs / Q8_BLOCK, block_bytes = Q8_BLOCK * j->bits / 8;
#ifdef Q8_AVX2
    if (!j->portable) {
        __m256i total = _mm256_setzero_si256();
        for (int64_t b = 0; b < blocks; b++)
            total = _mm256_add_epi32(total, q16_lanes_avx2(bytes + b * block_bytes,
                                                           j->bits, x + b * Q8_BLOCK,
                                                           (const q8_unpacker *)u));
        _mm256_storeu_si256((__m256i *)lanes, total);
        return;
    }
#endif
    (void)u;
    memset(lanes, 0, 8 * sizeof *lanes);
    for (int64_t b = 0; b < blocks; b++) {
        int32_t one[8];
        q16_lanes_portable(bytes + b * block_bytes, j->bits, x + b * Q8_BLOCK, one);
        for (int l = 0; l < 8; l++) lanes[l] += one[l];
    }
}

/* Rows [lo, hi) of one token, as the int8 product's rows (one at a time; the float parts in the
 * same order in every build: C arrays of 8 lanes). */
static void q16_rows_token(const q16_job *j, const int16_t *xq, const float *d,
                           const float *xsum, float *y, int32_t *dots, int64_t lo, int64_t hi) {
    const int64_t groups = j->padded_n / j->gs, group_nbytes = j->gs * j->bits / 8;
    uint8_t spare[MAX_GROUP + 32];
#ifdef Q8_AVX2
    const q8_unpacker unpacker = make_q8_unpacker(j->bits);
    const void *u = &unpacker;
#else
    const void *u = NULL;
#endif
    for (int64_t r = lo; r < hi; r++) {
        float acc[8] = {0}, o_sum = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = (const uint8_t *)j->qweight + (r * groups + g) * group_nbytes;
            if (r == hi - 1 && g == groups - 1) { /* the SIMD loads pass a group's end */
                memset(spare, 0, (size_t)group_nbytes + 32);
                memcpy(spare, bytes, (size_t)group_nbytes);
                bytes = spare;
            }
            prefetch_codes(bytes);
            int32_t lanes[8];
            q16_group_lanes(j, bytes, xq + g * j->gs, lanes, u);
            if (dots) {
                int32_t total = 0;
                for (int l = 0; l < 8; l++) total += lanes[l];
                dots[r * groups + g] = total;
                continue;
            }
            const float t = d[g] * bf16_value(j->scales[r * groups + g]);
            for (int l = 0; l < 8; l++) acc[l] += t * (float)lanes[l];
            o_sum += bf16_value(j->offsets[r * groups + g]) * xsum[g];
        }
        if (!dots) y[r] = lane_sum8_portable(acc) + o_sum;
    }
}

#ifdef Q8_AVX2
/* q16_rows_token's rows in registers (the same operations in the same order), `bits` a
 * constant after inlining; two rows at a time, as the int8 rows. */
static inline __attribute__((always_inline)) void q16_rows_avx2_bits(
    const q16_job *j, const int16_t *xq, const float *d, const float *xsum, float *y,
    int64_t lo, int64_t hi, int bits) {
    const int64_t groups = j->padded_n / j->gs, blocks = j->gs / Q8_BLOCK;
    const int64_t block_bytes = Q8_BLOCK * bits / 8, group_nbytes = j->gs * bits / 8;
    const q8_unpacker u = make_q8_unpacker(bits);
    uint8_t spare[MAX_GROUP + 32];
    for (int64_t r = lo; r < hi; r += 2) {
        const int two = r + 1 < hi;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float o0 = 0.0f, o1 = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b0 = (const uint8_t *)j->qweight + (r * groups + g) * group_nbytes;
            const uint8_t *b1 = b0 + groups * group_nbytes;
            if (r + 1 + two == hi && g == groups - 1) { /* the part's last group */
                memset(spare, 0, (size_t)group_nbytes + 32);
                memcpy(spare, two ? b1 : b0, (size_t)group_nbytes);
                if (two) b1 = spare; else b0 = spare;
            }
            prefetch_codes(b0);
            if (two) prefetch_codes(b1);
            const int16_t *xg = xq + g * j->gs;
            __m256i l0 = _mm256_setzero_si256(), l1 = _mm256_setzero_si256();
            for (int64_t b = 0; b < blocks; b++) {
                l0 = _mm256_add_epi32(l0, q16_lanes_avx2(b0 + b * block_bytes, bits, xg + b * Q8_BLOCK, &u));
                if (two)
                    l1 = _mm256_add_epi32(l1, q16_lanes_avx2(b1 + b * block_bytes, bits, xg + b * Q8_BLOCK, &u));
            }
            const float t0 = d[g] * bf16_value(j->scales[r * groups + g]);
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_set1_ps(t0), _mm256_cvtepi32_ps(l0)));
            o0 += bf16_value(j->offsets[r * groups + g]) * xsum[g];
            if (two) {
                const float t1 = d[g] * bf16_value(j->scales[(r + 1) * groups + g]);
                acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_set1_ps(t1), _mm256_cvtepi32_ps(l1)));
                o1 += bf16_value(j->offsets[(r + 1) * groups + g]) * xsum[g];
            }
        }
        y[r] = lane_sum8(acc0) + o0;
        if (two) y[r + 1] = lane_sum8(acc1) + o1;
    }
}

static void q16_rows_avx2(const q16_job *j, const int16_t *xq, const float *d,
                          const float *xsum, float *y, int64_t lo, int64_t hi) {
    switch (j->bits) {
    case 2: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 2); break;
    case 3: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 3); break;
    case 4: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 4); break;
    case 5: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 5); break;
    default: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 6); break;
    }
}
#endif

static int q16_rows(const void *ctx, int64_t lo, int64_t hi) {
    const q16_job *j = ctx;
    const int64_t groups = j->padded_n / j->gs;
    for (int64_t t = 0; t < j->m; t++) {
        const int16_t *xq = j->x.xq + t * j->padded_n;
        const float *d = j->x.d + t * groups, *xsum = j->x.xsum + t * groups;
        float *y = j->y ? j->y + t * j->y_stride : NULL;
#ifdef Q8_AVX2
        if (!j->portable && !j->dots) {
            q16_rows_avx2(j, xq, d, xsum, y, lo, hi);
            continue;
        }
#endif
        q16_rows_token(j, xq, d, xsum, y, j->dots, lo, hi);
    }
    return 0;
}

static int q16_supported(int64_t gs, int bits) {
    return gs % Q8_BLOCK == 0 && gs <= MAX_GROUP && bits >= 2 && bits <= 6;
}

/* The per-(row, group) integer sums of codes * xq for an int16 token xq [padded_n] in natural
 * order (tests against an int64 reference): dots [rows, groups]. */
int dq_q16_group_dots(const uint32_t *qweight, int64_t rows, int64_t padded_n, int64_t gs,
                      int bits, const int16_t *xq, int32_t *dots, int portable) {
    if (!q16_supported(gs, bits)) return -1;
    float *d = calloc((size_t)(2 * (padded_n / gs)), sizeof(float));
    int16_t *ordered = malloc((size_t)padded_n * sizeof(int16_t));
    int rc = -1;
    if (d && ordered) {
        q16_permute(xq, padded_n, bits, ordered);
        const q16_job j = {.qweight = qweight, .padded_n = padded_n, .gs = gs, .bits = bits,
                           .portable = portable,
                           .x = {.xq = ordered, .d = d, .xsum = d + padded_n / gs}, .m = 1,
                           .dots = dots};
        rc = q16_rows(&j, 0, rows);
    }
    free(d);
    free(ordered);
    return rc;
}

/* dq_matvec_q8_mt with int16 activations (widths 2-6). */
int dq_matvec_q16_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                     int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                     int64_t m, float *y, int64_t y_stride, int portable, int threads) {
    q16_tokens tokens;
    if (!q16_supported(gs, bits) || !(tokens = q16_quantize_tokens(x, m, padded_n, gs, bits)).d)
        return -1;
    const q16_job j = {.qweight = qweight, .scales = scales, .offsets = offsets,
                       .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable,
                       .x = tokens, .m = m, .y = y, .y_stride = y_stride};
    const int rc = dq_parallel(q16_rows, &j, rows, threads);
    free((void *)tokens.d);
    return rc;
}

/* dq_matvec_q8_one with int16 activations. */
int dq_matvec_q16_one(const int64_t *a, const float *x, float *y) {
    return dq_one_token(dq_matvec_q16_mt, a, x, y);
}

/* ---- expert pairs (MoE decode) ----
 * Pair p multiplies token x[p] with expert experts[p] of a bank, rows [lo, hi) of each expert:
 * job.m pairs, job.y [pairs, rows_per_expert], job.y_stride rows_per_expert; each pair's row
 * equals the one-token product of that expert alone. */
typedef struct {
    const void *job; /* a q8_job, or a q16_job where `wide` */
    int wide;
    const int64_t *experts;
    int64_t rows_per_expert;
} pairs_job;

/* Job `one` (a copy of j, int8 or int16: their fields are named alike) narrowed to pair p:
 * expert experts[p]'s rows, the pair's token (d_per: its scales a token) and output row. */
#define NARROW_TO_PAIR(one, j, pj, p, d_per)                                                   \
    do {                                                                                       \
        const int64_t groups_ = (j)->padded_n / (j)->gs, words_ = (j)->bits * (j)->gs / 32;   \
        const int64_t first_ = (pj)->experts[p] * (pj)->rows_per_expert;                      \
        (one).qweight = (j)->qweight + first_ * groups_ * words_;                              \
        (one).scales = (j)->scales + first_ * groups_;                                         \
        (one).offsets = (j)->offsets + first_ * groups_;                                       \
        (one).x.xq = (j)->x.xq + (p) * (j)->padded_n;                                          \
        (one).x.d = (j)->x.d + (p) * (d_per);                                                  \
        (one).x.xsum = (j)->x.xsum + (p) * groups_;                                            \
        (one).m = 1;                                                                           \
        (one).y = (j)->y + (p) * (j)->y_stride;                                                \
    } while (0)

static int pairs_rows(const void *ctx, int64_t lo, int64_t hi) {
    const pairs_job *pj = ctx;
    if (pj->wide) {
        const q16_job *j = pj->job;
        for (int64_t p = 0; p < j->m; p++) {
            q16_job one = *j;
            NARROW_TO_PAIR(one, j, pj, p, j->padded_n / j->gs);
            q16_rows(&one, lo, hi);
        }
        return 0;
    }
    const q8_job *j = pj->job;
    for (int64_t p = 0; p < j->m; p++) {
        q8_job one = *j;
        NARROW_TO_PAIR(one, j, pj, p, j->padded_n / Q8_BLOCK);
        q8_rows(&one, lo, hi);
    }
    return 0;
}

/* F.linear(x[p], W[experts[p]]) for every pair: x [pairs, padded_n] (zero padding), y [pairs,
 * rows_per_expert], the tokens quantized to int8 (wide: int16, widths 2-6); -1 if out of memory
 * or the layout is unsupported. */
int dq_matvec_integer_experts_mt(int wide, const uint32_t *qweight, const uint16_t *scales,
                                 const uint16_t *offsets, int64_t rows_per_expert,
                                 int64_t padded_n, int64_t gs, int bits, const int64_t *experts,
                                 int64_t pairs, const float *x, float *y, int threads) {
    if (!(wide ? q16_supported(gs, bits) : q8_supported(gs, bits))) return -1;
    const q16_tokens t16 = wide ? q16_quantize_tokens(x, pairs, padded_n, gs, bits)
                                : (q16_tokens){0};
    const q8_tokens t8 = wide ? (q8_tokens){0} : q8_quantize_tokens(x, pairs, padded_n, gs, bits);
    const float *owned = wide ? t16.d : t8.d;
    if (!owned) return -1;
    const q8_job j8 = {.qweight = qweight, .scales = scales, .offsets = offsets,
                       .padded_n = padded_n, .gs = gs, .bits = bits, .x = t8, .m = pairs, .y = y,
                       .y_stride = rows_per_expert};
    const q16_job j16 = {.qweight = qweight, .scales = scales, .offsets = offsets,
                         .padded_n = padded_n, .gs = gs, .bits = bits, .x = t16, .m = pairs,
                         .y = y, .y_stride = rows_per_expert};
    const pairs_job pj = {.job = wide ? (const void *)&j16 : (const void *)&j8, .wide = wide,
                          .experts = experts, .rows_per_expert = rows_per_expert};
    const int rc = dq_parallel(pairs_rows, &pj, rows_per_expert, threads);
    free((void *)owned);
    return rc;
}
