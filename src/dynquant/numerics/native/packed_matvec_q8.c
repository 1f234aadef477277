/* One token times a packed matrix with int8 activations: integer dot products on the codes.
 *
 * The format's groups are asymmetric, w = q * scale + offset, so over a group
 *   x . w = scale * (q . x) + offset * sum(x).
 * The token is quantized once per call to int8 in blocks of 32 (xq = round(x * 127 / amax),
 * d = amax / 127, as llama.cpp's Q8 blocks), and q . x over a block becomes an exact integer dot
 * product of unsigned codes with signed bytes: vpdpbusd where AVX-VNNI or AVX512-VNNI exist,
 * vpmaddubsw + vpmaddwd on AVX2 (8-bit codes: vpmaddwd of the even and the odd bytes widened in
 * place), plain C elsewhere. The offsets' part keeps the float sums of x.
 *
 * The result is defined, for every build, as:
 *   lane l (0..7) of block b: the int32 sum over positions p = 4l .. 4l+3 of
 *     codes[o(p)] * xq[o(p)], o the width's order of a block's 32 codes (exact):
 *     4 bits: o(p) = 2p, then 2(p - 16) + 1 (the low nibbles of the block's 16 bytes, then the
 *     high ones); 2 bits: o(p) = 4 (p % 8) + p / 8 (each byte's codes at one shift, byte by
 *     byte, shift after shift); 8 bits: o(p) = p; 3, 5 and 6 bits: with h = p / 16,
 *     r = (p % 16) / 8 and l = p % 8, o(p) = 16h + 4r + l / 2 + 8 (l % 2) (the 16-bit lanes
 *     of unpack32_words packed to bytes);
 *   4 bits where the group holds an even number of blocks (gs a multiple of 64): a pair of
 *     blocks 2k, 2k+1 fills the 8 lanes instead, lane l summing codes 8 (l % 4) .. 8 (l % 4) + 7
 *     of block 2k + l / 4 (each byte's two nibbles in one lane: one 32-byte load and one
 *     conversion to float for 64 codes); position p of the pair's 64 holds code
 *     32 ((p % 32) / 16) + 2 (p % 16) + p / 32 (the low nibbles of its 32 bytes, then the high);
 *   group g: gacc[l] = sum over its blocks, in order, of d[b] * float(lane l)   (mul, then add;
 *     pairs: over its pairs, d[b] the block of lane l);
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
 * themselves; without VNNI they go through vpmaddwd (vpmaddubsw saturates past 16 bits).
 */
#include "integer_dots.h"

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

/* Whether a width and group size take the pairs of blocks (the header). */
static inline int q8_pairs(int bits, int64_t gs) { return bits == 4 && gs % (2 * Q8_BLOCK) == 0; }

/* Which code of a pair of 4-bit blocks sits at position p (0 .. 63) of the pair (the header). */
static inline int q8_pair_order(int p) { return 32 * ((p % 32) / 16) + 2 * (p % 16) + p / 32; }

/* xq [n] in natural order -> out [n] in the width's order, block by block or pair by pair (out
 * may be xq). */
static void q8_permute(const int8_t *xq, int64_t n, int bits, int64_t gs, int8_t *out) {
    if (q8_pairs(bits, gs)) {
        int8_t pair[2 * Q8_BLOCK];
        for (int64_t b = 0; b < n; b += 2 * Q8_BLOCK) {
            memcpy(pair, xq + b, sizeof pair);
            for (int p = 0; p < 2 * Q8_BLOCK; p++) out[b + p] = pair[q8_pair_order(p)];
        }
        return;
    }
    int order[Q8_BLOCK];
    for (int p = 0; p < Q8_BLOCK; p++) order[p] = q8_order(bits, p);
    permute_blocks(xq, n, order, 1, out);
}

static inline int q8_permutes(int bits) { return bits != 8; }

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

/* The 8 integer lanes of a pair of 4-bit blocks (32 bytes), plain C, xq the pair's 64 values in
 * its order: lane l sums the pair's codes 8l .. 8l+7. */
static inline void pair_lanes_portable(const uint8_t *bytes, const int8_t *xq, int32_t *lanes) {
    uint8_t c[2 * Q8_BLOCK];
    block_codes(bytes, 4, c);
    block_codes(bytes + Q8_BLOCK / 2, 4, c + Q8_BLOCK);
    memset(lanes, 0, 8 * sizeof *lanes);
    for (int p = 0; p < 2 * Q8_BLOCK; p++) {
        const int code = q8_pair_order(p);
        lanes[code / 8] += (int32_t)c[code] * xq[p];
    }
}

#ifdef Q8_AVX2
/* 32 codes of 4 bits (16 bytes at p) in the order o: low nibbles, then high ones. */
static inline __m256i unpack32_4bit(const uint8_t *p) {
    return _mm256_and_si256(nibble_halves(p), _mm256_set1_epi8(0x0F));
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
#else /* even and odd bytes widened to 16 bits in place: two vpmaddwd give lane l's four */
    const __m256i even_x = _mm256_srai_epi16(_mm256_slli_epi16(xq, 8), 8);
    const __m256i even = _mm256_madd_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0xFF)), even_x);
    const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(c, 8), _mm256_srai_epi16(xq, 8));
    return _mm256_add_epi32(even, odd);
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

/* The 8 lanes of a pair of 4-bit blocks (32 bytes at p; xq the pair's 64 values in its order):
 * the low nibbles times the first 32 values plus the high nibbles times the rest, summed in 16
 * bits before one vpmaddwd (exact: each 16-bit sum is of four codes below 16 times |xq| <= 127,
 * below 2^15). */
static inline __m256i pair_lanes_avx2(const uint8_t *p, const int8_t *xq) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), c = _mm256_loadu_si256((const __m256i *)p);
    const __m256i lo = _mm256_and_si256(c, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
    const __m256i xa = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + Q8_BLOCK));
#ifdef Q8_VNNI
    return Q8_DPBUSD(Q8_DPBUSD(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa),
                                           _mm256_maddubs_epi16(hi, xb));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* The step of each lane of a pair starting at block k: d[k] in lanes 0-3, d[k + 1] in 4-7. */
static inline __m256 pair_steps(const float *d, int64_t k) {
    return _mm256_set_m128(_mm_set1_ps(d[k + 1]), _mm_set1_ps(d[k]));
}

#endif


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
            const int pairs = q8_pairs(j->bits, j->gs);
            for (int64_t b = 0; b < blocks; b += 1 + pairs) {
                const int64_t k = g * blocks + b;
                int32_t lanes[8];
                if (pairs)
                    pair_lanes_portable(row + k * block_bytes, xq + k * Q8_BLOCK, lanes);
                else
                    block_lanes_portable(row + k * block_bytes, j->bits, xq + k * Q8_BLOCK,
                                         lanes);
                for (int l = 0; l < 8; l++) {
                    gacc[l] += d[k + (pairs ? l / 4 : 0)] * (float)lanes[l];
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

/* Rows r .. r + rows_n - 1 (one or two) with `bits` and `pairs` (q8_pairs) constants after
 * inlining. Two rows at a time share the token's loads and give the out-of-order core two
 * independent chains of adds; each row's operations are the same as alone. `hi`: the part's end;
 * `tail`: its last row, whose last group is read from a padded copy (the SIMD loads pass a
 * group's end). */
static inline __attribute__((always_inline)) void q8_row_pair(
    const q8_job *j, const int8_t *xq, const float *d, const float *xsum, float *y, int64_t r,
    int64_t hi, int two, int tail, int bits, int pairs, const q8_unpacker *u, uint8_t *spare) {
    const int64_t groups = j->padded_n / j->gs, blocks = j->gs / Q8_BLOCK;
    const int64_t block_bytes = Q8_BLOCK * bits / 8, group_nbytes = j->gs * bits / 8;
    const uint8_t *row0 = (const uint8_t *)j->qweight + r * groups * group_nbytes;
    const uint8_t *row1 = row0 + groups * group_nbytes;
    const int64_t ahead = prefetch_ahead(groups * group_nbytes, hi - r - 2);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float o0 = 0.0f, o1 = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b0 = row0 + g * group_nbytes, *b1 = row1 + g * group_nbytes;
        start_group_pair(&b0, &b1, two, tail && g == groups - 1, group_nbytes, spare, ahead);
        __m256 g0 = _mm256_setzero_ps(), g1 = _mm256_setzero_ps();
        for (int64_t b = 0; pairs && b < blocks; b += 2) {
            const int64_t k = g * blocks + b;
            const __m256 dk = pair_steps(d, k);
            g0 = add_block(g0, pair_lanes_avx2(b0 + b * block_bytes, xq + k * Q8_BLOCK), dk);
            if (two) g1 = add_block(g1, pair_lanes_avx2(b1 + b * block_bytes, xq + k * Q8_BLOCK), dk);
        }
        for (int64_t b = 0; !pairs && b < blocks; b++) {
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
    int64_t hi, int bits, int pairs) {
    const q8_unpacker u = make_q8_unpacker(bits);
    uint8_t spare[MAX_GROUP + 32];
    prefetch_part_start(j->qweight, lo, hi, j->padded_n * bits / 8);
    int64_t r = lo;
    for (; r + 2 < hi; r += 2) q8_row_pair(j, xq, d, xsum, y, r, hi, 1, 0, bits, pairs, &u, spare);
    if (r + 2 == hi)
        q8_row_pair(j, xq, d, xsum, y, r, hi, 1, 1, bits, pairs, &u, spare);
    else if (r < hi)
        q8_row_pair(j, xq, d, xsum, y, r, hi, 0, 1, bits, pairs, &u, spare);
}

static void q8_rows_avx2(const q8_job *j, const int8_t *xq, const float *d, const float *xsum,
                         float *y, int64_t lo, int64_t hi) {
    switch (j->bits) { /* constant widths: shifts, loads and the 8-bit test fold away */
    case 2: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 2, 0); break;
    case 3: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 3, 0); break;
    case 4:
        if (q8_pairs(4, j->gs))
            q8_rows_bits(j, xq, d, xsum, y, lo, hi, 4, 1);
        else
            q8_rows_bits(j, xq, d, xsum, y, lo, hi, 4, 0);
        break;
    case 5: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 5, 0); break;
    case 6: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 6, 0); break;
    default: q8_rows_bits(j, xq, d, xsum, y, lo, hi, 8, 0); break;
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
            const int pairs = q8_pairs(j->bits, j->gs);
            for (int64_t b = 0; b < blocks; b += 1 + pairs) {
                const int8_t *x = xq + (g * blocks + b) * Q8_BLOCK;
                const __m256i lanes = pairs ? pair_lanes_avx2(bytes + b * block_bytes, x)
                                            : block_lanes_avx2(bytes + b * block_bytes, x, &u);
                total = _mm256_add_epi32(total, lanes);
            }
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, total);
            j->dots[r * groups + g] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
        }
}
#endif

/* Rows [lo, hi) for every token, token after token (each reads the rows' codes again: a few
 * tokens' codes stay in cache). */
int q8_rows(const void *ctx, int64_t lo, int64_t hi) {
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
    if (q8_permutes(bits)) q8_permute(xq, n, bits, gs, xq);
}

/* m tokens x [m, padded_n] quantized (q8_quantize_ordered) into one allocation, owned by the
 * result's d (free it); d NULL if out of memory. */
q8_tokens q8_quantize_tokens(const float *x, int64_t m, int64_t padded_n, int64_t gs,
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

int q8_supported(int64_t gs, int bits) {
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
        q8_permute(xq, padded_n, bits, gs, ordered);
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
int dq_matvec_q8_one(const dq_packed_block *block, const float *x, float *y) {
    return dq_one_token(dq_matvec_q8_mt, block, x, y);
}
