/* One token times a packed matrix with int16 activations: packed_matvec_q8.c's product with the
 * token quantized to int16 per group of the layout (d[g] = amax / 32767
 * over the group's gs values): GPTQ's 2- and 3-bit codes carry a large error in directions the
 * calibration's activations do not use, and int8's noise reaches those directions
 * (BENCHMARKS.md, "Against llama.cpp"); at 16 bits that noise is ~100 times smaller. Widths 2-6.
 * A block's position p holds code q16_code(bits, p) (the 16-bit lanes the AVX2 unpacking leaves)
 * and lane l sums positions 2l, 2l+1, 16+2l and 17+2l (vpmaddwd on each half, then the halves
 * added). A group's lanes are summed over its blocks, and then together, as integers (exact:
 * codes < 64, |xq| <= 32767, gs <= 1024: |sum| < 2^31) into the group's dot q . xq, so the float
 * work is once per group, group g in float lane l = g % 8 (eight groups in one vector):
 *   acc[l] = acc[l] + (d[g] * scale[g]) * float(dot_g)            (mul, mul, then add);
 *   off[l] = off[l] + offset[g] * xsum[g]                          (mul, then add);
 *   y = sum8(acc) + sum8(off),  sum8(a) = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)),
 * xsum[g] = d[g] * float(the group's integer sum of xq); past the last group (groups not a
 * multiple of 8) the terms are +0.
 * With AVX-512 VBMI and VNNI the 2- and 3-bit products take the token split (q16_split_group):
 * xq = 256 hi + lo, hi = xq >> 8 (int8), lo = xq & 255 (uint8), and a group's dot is
 * 256 (q . hi) + q . lo, each from VNNI's byte products (vpdpbusd: q . hi with the codes as the
 * unsigned bytes, q . lo with them as the signed ones, codes < 128): the same integers, 64 codes
 * unpacked a byte each by one vpermb and one vpmultishiftqb (2 bits: one shift) and a mask where
 * the 16-bit lanes take a shuffle and a mask for every 32 (q16_group_split). */
#include "integer_dots.h"

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

/* The group sums of a token quantized per group (d one per group). */
static void q16_group_sums(const int16_t *xq, const float *d, int64_t n, int64_t gs,
                           float *xsum) {
    for (int64_t g = 0; g < n / gs; g++) {
        int32_t isum = 0;
        for (int64_t j = g * gs; j < (g + 1) * gs; j++) isum += xq[j];
        xsum[g] = d[g] * (float)isum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && \
    defined(__AVX512VNNI__)
#define Q16_SPLIT 1
#endif

/* Whether this build's products take int16 tokens of `bits`-bit codes split into bytes. */
static int q16_splits(int bits, int portable) {
#ifdef Q16_SPLIT
    return !portable && (bits == 2 || bits == 3);
#else
    (void)bits, (void)portable;
    return 0;
#endif
}

/* Which value of a group's 64 (or, `half`, its last 32) sits at byte p of the split token: for
 * 3 bits value p (split_codes64 puts the codes in order); for 2 bits qword j = p / 8, byte i =
 * p % 8 holds code 32 (j % 2) + 4 i + j / 2 (half: 4 i + j, j < 4), where split_codes64's
 * shifts leave it. */
static inline int q16_split_value(int bits, int half, int p) {
    const int j = p / 8, i = p % 8;
    if (bits != 2) return p;
    return half ? 4 * i + j : 32 * (j % 2) + 4 * i + j / 2;
}

/* A group's gs int16 values (natural order) in place as their gs high bytes (int8: v >> 8)
 * then their gs low bytes (uint8: v & 255), each 64 (and a last 32) in q16_split_value's
 * order; v = 256 hi + lo. */
static void q16_split_group(int16_t *v, int64_t gs, int bits) {
    int16_t copy[MAX_GROUP];
    memcpy(copy, v, (size_t)gs * sizeof *v);
    int8_t *hi = (int8_t *)v;
    uint8_t *lo = (uint8_t *)v + gs;
    for (int64_t c = 0; c < gs; c += 64) {
        const int half = c + 64 > gs;
        for (int p = 0; p < (half ? 32 : 64); p++) {
            const int16_t x = copy[c + q16_split_value(bits, half, p)];
            hi[c + p] = (int8_t)(x >> 8);
            lo[c + p] = (uint8_t)(x & 255);
        }
    }
}

/* Each block of 32 of q [n] (natural order) into q16_code's order for `bits` (out may be q). */
static void q16_permute(const int16_t *q, int64_t n, int bits, int16_t *out) {
    int order[Q8_BLOCK];
    for (int p = 0; p < Q8_BLOCK; p++) order[p] = q16_code(bits, p);
    permute_blocks(q, n, order, (int)sizeof *q, out);
}

/* A token's n int16 values (natural order) as the products read them (out may be q): each
 * group split into bytes where `split` (q16_split_group), else each block in q16_code's order. */
static void q16_arrange(const int16_t *q, int64_t n, int64_t gs, int bits, int split,
                        int16_t *out) {
    if (!split) {
        q16_permute(q, n, bits, out);
        return;
    }
    if (out != q) memcpy(out, q, (size_t)n * sizeof *q);
    for (int64_t g = 0; g < n / gs; g++) q16_split_group(out + g * gs, gs, bits);
}

q16_tokens q16_quantize_tokens(const float *x, int64_t m, int64_t padded_n, int64_t gs,
                                      int bits, int portable) {
    const int64_t groups = padded_n / gs;
    q16_tokens t = {0};
    float *d = malloc((size_t)(2 * m * groups + 8) * sizeof(float) +
                      (size_t)(m * padded_n) * sizeof(int16_t));
    if (!d) return t;
    /* 8 zeros after the sums: q16_float8 reads a row's last groups 8 at a time */
    memset(d + 2 * m * groups, 0, 8 * sizeof(float));
    int16_t *xq = (int16_t *)(d + 2 * m * groups + 8);
    float *xsum = d + m * groups;
    t.split = q16_splits(bits, portable);
    for (int64_t i = 0; i < m; i++) {
        int16_t *q = xq + i * padded_n;
        dq_q16_quantize(x + i * padded_n, padded_n, gs, q, d + i * groups);
        q16_group_sums(q, d + i * groups, padded_n, gs, xsum + i * groups);
        q16_arrange(q, padded_n, gs, bits, t.split, q);
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
/* A block's 32 codes of 4-6 bits in two registers of 16-bit lanes (q16_code's order): 4 bits by
 * masks and shifts of the 16 bytes in place (shifted by a nibble), 5 and 6 by unpack32_words
 * (2 and 3 bits: q16_group_avx2). */
static inline __attribute__((always_inline)) void q16_unpack(const uint8_t *p, int bits,
                                                             const q8_unpacker *u, __m256i *lo,
                                                             __m256i *hi) {
    if (bits == 4) {
        const __m256i v = nibble_halves(p), mask = _mm256_set1_epi16(15);
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

/* A block's 3-bit codes masked where the shuffle leaves them (code << shift: the shift is the
 * same for a 32-bit lane's two halves) times the token's 32 values, added to the lanes a, b. */
static inline __attribute__((always_inline)) void q16_masked3(const uint8_t *p, const int16_t *x,
                                                              const q8_unpacker *u, __m256i *a,
                                                              __m256i *b) {
    const __m256i v = q8_window(p, 3);
    *a = Q8_DPWSSD(*a, _mm256_and_si256(_mm256_shuffle_epi8(v, u->shuffle_lo), u->mask_lo),
                   _mm256_loadu_si256((const __m256i *)x));
    *b = Q8_DPWSSD(*b, _mm256_and_si256(_mm256_shuffle_epi8(v, u->shuffle_hi), u->mask_hi),
                   _mm256_loadu_si256((const __m256i *)(x + 16)));
}

/* A 2-bit block's 8 bytes broadcast to every qword, its codes masked in place (q16_code's 2-bit
 * order: qword q's codes at bit 2q of each 16-bit half, the upper byte's after a shift by 8;
 * `mask` 3 << 2q) times the token's 32 values, added to the lanes a, b. */
static inline __attribute__((always_inline)) void q16_masked2(const uint8_t *p, const int16_t *x,
                                                              __m256i mask, __m256i *a,
                                                              __m256i *b) {
    int64_t w;
    memcpy(&w, p, sizeof w);
    const __m256i v = _mm256_set1_epi64x(w);
    *a = Q8_DPWSSD(*a, _mm256_and_si256(v, mask), _mm256_loadu_si256((const __m256i *)x));
    *b = Q8_DPWSSD(*b, _mm256_and_si256(_mm256_srli_epi16(v, 8), mask),
                   _mm256_loadu_si256((const __m256i *)(x + 16)));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q16_AVX512 1
#ifdef __AVX512VNNI__
#define Q16_DPWSSD512(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define Q16_DPWSSD512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif

static inline __m512i q16_join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* q16_group_avx2's 2- and 3-bit sums with a whole block in one 512-bit register: its lower half
 * the AVX2 loop's `a` lanes, its upper half the `b` lanes (a block costs one shuffle or shift,
 * one mask and one dot product where the AVX2 loop takes two of each), the halves shifted as
 * there and added: the same integers. (A vpermb of four blocks loaded at once, in place of the
 * broadcasts, ran slower on AMD Zen 5.) */
static inline __attribute__((always_inline)) __m256i q16_group_512(
    const uint8_t *p0, const uint8_t *p1, int two, int bits, const int16_t *x, int64_t blocks,
    const q8_unpacker *u, __m256i *l1) {
    const int64_t block_bytes = Q8_BLOCK * bits / 8;
    const __m256i shift2 = _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6);
    const __m256i mask2 = _mm256_sllv_epi32(_mm256_set1_epi32(0x30003), shift2);
    const __m512i shift = bits == 2 ? q16_join(shift2, shift2) : q16_join(u->shift_lo, u->shift_hi);
    const __m512i mask = bits == 2 ? q16_join(mask2, mask2) : q16_join(u->mask_lo, u->mask_hi);
    const __m512i shuffle = q16_join(u->shuffle_lo, u->shuffle_hi);
    /* 2 bits: the upper half's codes are the lower's shifted by 8 (q16_masked2) */
    const __m512i half = _mm512_setr_epi64(0, 0, 0, 0, 8, 8, 8, 8);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *q0 = p0 + k * block_bytes, *q1 = p1 + k * block_bytes;
        const __m512i xk = _mm512_loadu_si512(x + k * Q8_BLOCK);
        __m512i c0, c1 = a1;
        if (bits == 2) {
            int64_t w0, w1;
            memcpy(&w0, q0, sizeof w0);
            c0 = _mm512_srlv_epi64(_mm512_set1_epi64(w0), half);
            if (two) {
                memcpy(&w1, q1, sizeof w1);
                c1 = _mm512_srlv_epi64(_mm512_set1_epi64(w1), half);
            }
        } else {
            c0 = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q0)),
                                     shuffle);
            if (two)
                c1 = _mm512_shuffle_epi8(
                    _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q1)), shuffle);
        }
        a0 = Q16_DPWSSD512(a0, _mm512_and_si512(c0, mask), xk);
        if (two) a1 = Q16_DPWSSD512(a1, _mm512_and_si512(c1, mask), xk);
    }
    a0 = _mm512_srav_epi32(a0, shift);
    a1 = _mm512_srav_epi32(a1, shift);
    *l1 = _mm256_add_epi32(_mm512_castsi512_si256(a1), _mm512_extracti64x4_epi64(a1, 1));
    return _mm256_add_epi32(_mm512_castsi512_si256(a0), _mm512_extracti64x4_epi64(a0, 1));
}
#endif

#ifdef Q16_SPLIT
/* 64 codes of `bits` (2 or 3) bits at p (`half`: 32, the upper qwords' bytes then any), a byte
 * each in q16_split_value's order. 3 bits: unit j's 3 bytes (8 codes) moved to qword j (vpermb),
 * code i of it to byte i (vpmultishiftqb: the 8 bits from bit 3 i), masked; reads 32 bytes from
 * p. 2 bits: the 16 bytes (half: 8) in every pair of qwords (every qword), each shifted by 2 (j /
 * 2) (half: 2 (j % 4)), masked: one shift where 3 bits take two shuffles (BENCHMARKS.md,
 * "Memory bandwidth"); reads 16 (half: 8) bytes. */
static inline __attribute__((always_inline)) __m512i split_codes64(const uint8_t *p, int bits,
                                                                   int half) {
    if (bits == 2) {
        __m512i v, shifts;
        if (half) {
            int64_t w;
            memcpy(&w, p, sizeof w);
            v = _mm512_set1_epi64(w);
            shifts = _mm512_setr_epi64(0, 2, 4, 6, 0, 2, 4, 6);
        } else {
            v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
            shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6);
        }
        return _mm512_and_si512(_mm512_srlv_epi64(v, shifts), _mm512_set1_epi8(3));
    }
    const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    /* byte i of qword j <- byte 3 j + i; code i <- bits 3 i .. 3 i + 7 of the qword */
    const int64_t first = 0x0706050403020100LL, unit = 0x0303030303030303LL;
    const __m512i index = _mm512_setr_epi64(first, first + unit, first + 2 * unit,
                                            first + 3 * unit, first + 4 * unit, first + 5 * unit,
                                            first + 6 * unit, first + 7 * unit);
    const __m512i shifts = _mm512_set1_epi64(0x15120f0c09060300LL);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(index, v)),
                            _mm512_set1_epi8(7));
}

/* q16_group_avx2's lanes for tokens split into bytes (q16_split_group at x): each 64 codes' q .
 * hi and q . lo summed in their own lanes (vpdpbusd), then 256 hi + lo, the 16 lanes folded to 8.
 * A group's last 32 codes (gs = 32 (2k + 1)) with the token's bytes past them zero. Exact: a lane
 * gains at most 4 * 7 * 128 (hi) or 4 * 7 * 255 (lo) a 64 codes, 16 of them (MAX_GROUP) times
 * 256 < 2^31. */
static inline __attribute__((always_inline)) __m256i q16_group_split(
    const uint8_t *p0, const uint8_t *p1, int two, int bits, const int16_t *x, int64_t blocks,
    __m256i *l1) {
    const int64_t gs = blocks * Q8_BLOCK;
    const int8_t *hi = (const int8_t *)x;
    const uint8_t *lo = (const uint8_t *)x + gs;
    __m512i h0 = _mm512_setzero_si512(), o0 = h0, h1 = h0, o1 = h0;
    for (int64_t c = 0; c < gs; c += 64) {
        const int whole = c + 64 <= gs;
        const __m512i xh = whole ? _mm512_loadu_si512(hi + c)
                                 : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(hi + c)));
        const __m512i xl = whole ? _mm512_loadu_si512(lo + c)
                                 : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(lo + c)));
        const __m512i c0 = split_codes64(p0 + c * bits / 8, bits, !whole);
        h0 = _mm512_dpbusd_epi32(h0, c0, xh);
        o0 = _mm512_dpbusd_epi32(o0, xl, c0);
        if (two) {
            const __m512i c1 = split_codes64(p1 + c * bits / 8, bits, !whole);
            h1 = _mm512_dpbusd_epi32(h1, c1, xh);
            o1 = _mm512_dpbusd_epi32(o1, xl, c1);
        }
    }
    h0 = _mm512_add_epi32(_mm512_slli_epi32(h0, 8), o0);
    h1 = _mm512_add_epi32(_mm512_slli_epi32(h1, 8), o1);
    *l1 = _mm256_add_epi32(_mm512_castsi512_si256(h1), _mm512_extracti64x4_epi64(h1, 1));
    return _mm256_add_epi32(_mm512_castsi512_si256(h0), _mm512_extracti64x4_epi64(h0, 1));
}
#endif

/* The 8 integer lanes of a group's `blocks` blocks at p0 (and at p1 where `two`, into *l1).
 * 2 and 3 bits: q16_masked2/3's sums, each code left where the unpacking finds it (code <<
 * shift, the shift the same for a 32-bit lane's two halves), then the shifts once a group on the
 * sums, exact multiples of 2^shift: the same integers as shifting every block, one (2 bits) or
 * two (3 bits) vector shifts fewer a block. Exact for groups up to MAX_GROUP: a block adds at
 * most 2 * (7 << 7) * 32767 < 2^26 to a lane, 32 blocks < 2^31. */
static inline __attribute__((always_inline)) __m256i q16_group_avx2(
    const uint8_t *p0, const uint8_t *p1, int two, int bits, const int16_t *x, int64_t blocks,
    const q8_unpacker *u, int split, __m256i *l1) {
#ifdef Q16_SPLIT
    if (split) return q16_group_split(p0, p1, two, bits, x, blocks, l1);
#endif
    (void)split;
#ifdef Q16_AVX512
    if (bits == 2 || bits == 3) return q16_group_512(p0, p1, two, bits, x, blocks, u, l1);
#endif
    const int64_t block_bytes = Q8_BLOCK * bits / 8;
    __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
    if (bits == 2 || bits == 3) {
        const __m256i shift2 = _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6);
        const __m256i mask2 = _mm256_sllv_epi32(_mm256_set1_epi32(0x30003), shift2);
        const __m256i shift_a = bits == 2 ? shift2 : u->shift_lo;
        const __m256i shift_b = bits == 2 ? shift2 : u->shift_hi;
        __m256i a0 = t0, b0 = t0, a1 = t0, b1 = t0;
        for (int64_t k = 0; k < blocks; k++) {
            const uint8_t *q0 = p0 + k * block_bytes, *q1 = p1 + k * block_bytes;
            const int16_t *xk = x + k * Q8_BLOCK;
            if (bits == 2) {
                q16_masked2(q0, xk, mask2, &a0, &b0);
                if (two) q16_masked2(q1, xk, mask2, &a1, &b1);
            } else {
                q16_masked3(q0, xk, u, &a0, &b0);
                if (two) q16_masked3(q1, xk, u, &a1, &b1);
            }
        }
        t0 = _mm256_add_epi32(_mm256_srav_epi32(a0, shift_a), _mm256_srav_epi32(b0, shift_b));
        t1 = _mm256_add_epi32(_mm256_srav_epi32(a1, shift_a), _mm256_srav_epi32(b1, shift_b));
    } else {
        for (int64_t k = 0; k < blocks; k++) {
            const int16_t *xk = x + k * Q8_BLOCK;
            t0 = _mm256_add_epi32(t0, q16_lanes_avx2(p0 + k * block_bytes, bits, xk, u));
            if (two) t1 = _mm256_add_epi32(t1, q16_lanes_avx2(p1 + k * block_bytes, bits, xk, u));
        }
    }
    *l1 = t1;
    return t0;
}
#endif

/* A group's 8 integer lanes summed over its blocks: AVX2 or portable (the same integers). */
static inline void q16_group_lanes(const q16_job *j, const uint8_t *bytes, const int16_t *x,
                                   int32_t *lanes, const void *u) {
    const int64_t blocks = j->gs / Q8_BLOCK, block_bytes = Q8_BLOCK * j->bits / 8;
#ifdef Q8_AVX2
    if (!j->portable) {
        __m256i unused;
        _mm256_storeu_si256((__m256i *)lanes,
                            q16_group_avx2(bytes, bytes, 0, j->bits, x, blocks,
                                           (const q8_unpacker *)u, j->x.split, &unused));
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
    const int64_t padded_groups = (groups + 7) / 8 * 8;
    for (int64_t r = lo; r < hi; r++) {
        float acc[8] = {0}, off[8] = {0};
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
            int32_t dot = 0;
            for (int l = 0; l < 8; l++) dot += lanes[l];
            if (dots) {
                dots[r * groups + g] = dot;
                continue;
            }
            const float t = d[g] * bf16_value(j->scales[r * groups + g]);
            acc[g % 8] += t * (float)dot;
            off[g % 8] += bf16_value(j->offsets[r * groups + g]) * xsum[g];
        }
        if (dots) continue;
        for (int64_t g = groups; g < padded_groups; g++) { /* the vector path's zero lanes */
            acc[g % 8] += 0.0f;
            off[g % 8] += 0.0f;
        }
        y[r] = lane_sum8_portable(acc) + lane_sum8_portable(off);
    }
}

#ifdef Q8_AVX2
/* Eight groups' lane vectors v[0..7] as their eight dots (integer sums: exact in any order). */
static inline __m256i q16_dots8(const __m256i *v) {
    const __m256i f = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                        _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                        _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(f, h, 0x20),
                            _mm256_permute2x128_si256(f, h, 0x31));
}

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The header's float work for groups [g0, g0 + n) (n <= 8; the rest's terms +0) of one row:
 * its scales and offsets at s, o. A row's last groups (n < 8) are read 8 at a time and the
 * lanes past them zeroed, where `past` says that 8 - n more scales and offsets follow the row's
 * (a later row's: not the part's last row; the token's sums have 8 zeros after them): a copy
 * of n values is a call to memcpy, which spills every vector register (on rows of 576 codes
 * in groups of 64, a 3-bit product took 1.6x as long a block as on rows of 512). */
static inline __attribute__((always_inline)) void q16_float8(
    __m256 *acc, __m256 *off, __m256i dots, const float *d, const float *xsum, const uint16_t *s,
    const uint16_t *o, int64_t g0, int64_t n, int past) {
    __m256 dv, xv, sv, ov;
    if (n == 8) {
        dv = _mm256_loadu_ps(d + g0), xv = _mm256_loadu_ps(xsum + g0);
        sv = bf16x8(s + g0), ov = bf16x8(o + g0);
    } else if (past) {
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        dv = _mm256_and_ps(_mm256_loadu_ps(d + g0), live);
        xv = _mm256_and_ps(_mm256_loadu_ps(xsum + g0), live);
        sv = _mm256_and_ps(bf16x8(s + g0), live);
        ov = _mm256_and_ps(bf16x8(o + g0), live);
    } else {
        float dd[8] = {0}, xx[8] = {0};
        uint16_t ss[8] = {0}, oo[8] = {0};
        memcpy(dd, d + g0, (size_t)n * sizeof *dd);
        memcpy(xx, xsum + g0, (size_t)n * sizeof *xx);
        memcpy(ss, s + g0, (size_t)n * sizeof *ss);
        memcpy(oo, o + g0, (size_t)n * sizeof *oo);
        dv = _mm256_loadu_ps(dd), xv = _mm256_loadu_ps(xx), sv = bf16x8(ss), ov = bf16x8(oo);
    }
    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(_mm256_mul_ps(dv, sv), _mm256_cvtepi32_ps(dots)));
    *off = _mm256_add_ps(*off, _mm256_mul_ps(ov, xv));
}

/* q16_rows_token's rows r (and r + 1 where `two`) in registers (the same operations in the same
 * order: eight groups a vector), `bits`, `two`, `tail` and `blocks` (a group's blocks, 0:
 * j->gs's) constants after inlining, as the int8 rows' pairs: `tail`, the part's last row, whose
 * last group is read from a padded copy. */
static inline __attribute__((always_inline)) void q16_row_pair(
    const q16_job *j, const int16_t *xq, const float *d, const float *xsum, float *y, int64_t r,
    int64_t hi, int two, int tail, int bits, int64_t blocks, const q8_unpacker *u, int split,
    uint8_t *spare) {
    const int64_t groups = j->padded_n / j->gs;
    if (!blocks) blocks = j->gs / Q8_BLOCK;
    const int64_t group_nbytes = j->gs * bits / 8;
    const int64_t ahead = prefetch_ahead(groups * group_nbytes, hi - r - 2);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, off0 = acc0, off1 = acc0;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int64_t n = groups - g0 < 8 ? groups - g0 : 8;
        __m256i v0[8], v1[8];
        /* unrolled: the groups' lanes in registers, not in memory (3 bits, SmolLM2's and the
         * 7B MLP's widths in cache: 1.1-1.2x on AMD Zen 5) */
#pragma GCC unroll 8
        for (int64_t k = 0; k < 8; k++) {
            v0[k] = v1[k] = _mm256_setzero_si256();
            if (k >= n) continue;
            const int64_t g = g0 + k;
            const uint8_t *b0 = (const uint8_t *)j->qweight + (r * groups + g) * group_nbytes;
            const uint8_t *b1 = b0 + groups * group_nbytes;
            start_group_pair(&b0, &b1, two, tail && g == groups - 1, group_nbytes, spare, ahead);
            v0[k] = q16_group_avx2(b0, b1, two, bits, xq + g * j->gs, blocks, u, split, &v1[k]);
        }
        q16_float8(&acc0, &off0, q16_dots8(v0), d, xsum, j->scales + r * groups,
                   j->offsets + r * groups, g0, n, !tail);
        if (two)
            q16_float8(&acc1, &off1, q16_dots8(v1), d, xsum, j->scales + (r + 1) * groups,
                       j->offsets + (r + 1) * groups, g0, n, !tail);
    }
    y[r] = lane_sum8(acc0) + lane_sum8(off0);
    if (two) y[r + 1] = lane_sum8(acc1) + lane_sum8(off1);
}

static inline __attribute__((always_inline)) void q16_rows_avx2_bits(
    const q16_job *j, const int16_t *xq, const float *d, const float *xsum, float *y,
    int64_t lo, int64_t hi, int bits, int64_t blocks, int split) {
    const q8_unpacker u = make_q8_unpacker(bits);
    uint8_t spare[MAX_GROUP + 32];
    prefetch_part_start(j->qweight, lo, hi, j->padded_n * bits / 8);
    int64_t r = lo;
    for (; r + 2 < hi; r += 2)
        q16_row_pair(j, xq, d, xsum, y, r, hi, 1, 0, bits, blocks, &u, split, spare);
    if (r + 2 == hi)
        q16_row_pair(j, xq, d, xsum, y, r, hi, 1, 1, bits, blocks, &u, split, spare);
    else if (r < hi)
        q16_row_pair(j, xq, d, xsum, y, r, hi, 0, 1, bits, blocks, &u, split, spare);
}

/* The widths `auto` gives int16 tokens (2 and 3 bits) with the format's group sizes as constants:
 * a group's blocks unrolled (3 bits, groups of 128: 1.1x, SPR). */
static inline __attribute__((always_inline)) void q16_rows_avx2_groups(
    const q16_job *j, const int16_t *xq, const float *d, const float *xsum, float *y,
    int64_t lo, int64_t hi, int bits, int split) {
    switch (j->gs) {
    case 32: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, bits, 1, split); break;
    case 64: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, bits, 2, split); break;
    case 128: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, bits, 4, split); break;
    default: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, bits, 0, split); break;
    }
}

static void q16_rows_avx2(const q16_job *j, const int16_t *xq, const float *d,
                          const float *xsum, float *y, int64_t lo, int64_t hi) {
    const int split = j->x.split; /* a constant in each instance */
    switch (j->bits) {
    case 2:
        if (split) q16_rows_avx2_groups(j, xq, d, xsum, y, lo, hi, 2, 1);
        else q16_rows_avx2_groups(j, xq, d, xsum, y, lo, hi, 2, 0);
        break;
    case 3:
        if (split) q16_rows_avx2_groups(j, xq, d, xsum, y, lo, hi, 3, 1);
        else q16_rows_avx2_groups(j, xq, d, xsum, y, lo, hi, 3, 0);
        break;
    case 4: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 4, 0, 0); break;
    case 5: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 5, 0, 0); break;
    default: q16_rows_avx2_bits(j, xq, d, xsum, y, lo, hi, 6, 0, 0); break;
    }
}
#endif

int q16_rows(const void *ctx, int64_t lo, int64_t hi) {
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

int q16_supported(int64_t gs, int bits) {
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
        const int split = q16_splits(bits, portable);
        q16_arrange(xq, padded_n, gs, bits, split, ordered);
        const q16_job j = {.qweight = qweight, .padded_n = padded_n, .gs = gs, .bits = bits,
                           .portable = portable,
                           .x = {.xq = ordered, .d = d, .xsum = d + padded_n / gs, .split = split},
                           .m = 1, .dots = dots};
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
    if (!q16_supported(gs, bits) ||
        !(tokens = q16_quantize_tokens(x, m, padded_n, gs, bits, portable)).d)
        return -1;
    const q16_job j = {.qweight = qweight, .scales = scales, .offsets = offsets,
                       .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable,
                       .x = tokens, .m = m, .y = y, .y_stride = y_stride};
    const int rc = dq_parallel(q16_rows, &j, rows, threads);
    free((void *)tokens.d);
    return rc;
}

/* dq_matvec_q8_one with int16 activations. */
int dq_matvec_q16_one(const dq_packed_block *block, const float *x, float *y) {
    return dq_one_token(dq_matvec_q16_mt, block, x, y);
}
