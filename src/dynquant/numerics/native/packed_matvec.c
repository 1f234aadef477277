/* dynquant's packed matrix-vector product: y = x @ W^T straight from the packed format, for a few
 * tokens at a time (decode), without materialising W.
 *
 * W is [rows, padded_n] in groups of gs along each row, w = q * scale + offset with bf16
 * scale/offset:
 *   y[t, r] = sum_g scale[r, g] * (q[r, g, :] . x[t, g, :]) + offset[r, g] * sum(x[t, g, :])
 * in float32. A group is unpacked once (unpack.h: AVX-512 VBMI, AVX2 or portable); its products
 * with a token are summed in 16 lanes (lane l: j % 16 == l, in order of j), each lane scaled by
 * the group's scale and added to the row's 16 running lanes, group after group; the row's lanes
 * are combined once, as lane_sum's fixed tree, and the offsets' sum (group after group) added.
 * Every unpack path computes exactly this, so all give the same bits. The lanes are combined
 * once a row, not once a group: a horizontal sum per group costs more than the group's
 * multiply-adds at small group sizes.
 */
#include "pool.h"
#include "unpack.h"

/* A group's 16 lane sums of q . x, scaled by s and added to the row's running lanes. */
static inline void add_scaled_lanes(const float *q, const float *x, int64_t gs, float s,
                                    float *tot) {
    float acc[LANES] = {0};
    for (int64_t j = 0; j < gs; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += q[j + l] * x[j + l];
    for (int l = 0; l < LANES; l++) tot[l] += s * acc[l];
}

int dq_matvec_has_simd(void) { return dq_has_simd(); }

#ifdef DQ_HAVE_VBMI
/* A group's 16 lane sums of codes . x for one token, codes kept in registers: lane l sums
 * j % 16 == l in order of j, exactly as add_scaled_lanes does after unpacking to memory. */
static inline __m512 lanes_codes_vbmi(const uint8_t *bytes, int64_t gs, int bits,
                                      const unpacker *u, const float *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < gs; j += 64) {
        const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, 64, u);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 0), _mm512_loadu_ps(x + j)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 1), _mm512_loadu_ps(x + j + 16)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 2), _mm512_loadu_ps(x + j + 32)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 3), _mm512_loadu_ps(x + j + 48)));
    }
    return acc;
}
#endif

#ifdef DQ_HAVE_AVX2
/* The same for AVX2: a group's 16 lane sums of codes . x for one token, lanes 0-7 in lo and 8-15
 * in hi. Unit k (8 codes) goes to lanes 8 * (k % 2) .. + 7, so the two ymm accumulators hold
 * exactly add_scaled_lanes' partial sums. */
typedef struct {
    __m256 lo, hi;
} lanes16;

static inline lanes16 lanes_codes_avx2(const uint8_t *bytes, int64_t gs, int bits,
                                       const avx2_unpacker *u, const float *x) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < gs / 8; k += 2) {
        __m256 q0, q1;
        unit_pair_avx2(bytes, k, bits, gs * bits / 8, u, &q0, &q1);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(q0, _mm256_loadu_ps(x + 8 * k)));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(q1, _mm256_loadu_ps(x + 8 * k + 8)));
    }
    const lanes16 out = {acc0, acc1};
    return out;
}

static inline lanes16 lanes_codes_avx2_bits(const uint8_t *bytes, int64_t gs, int bits,
                                            const avx2_unpacker *u, const float *x) {
    switch (bits) { /* constant widths: the unit loads become single loads */
    case 2: return lanes_codes_avx2(bytes, gs, 2, u, x);
    case 3: return lanes_codes_avx2(bytes, gs, 3, u, x);
    case 4: return lanes_codes_avx2(bytes, gs, 4, u, x);
    case 8: return lanes_codes_avx2(bytes, gs, 8, u, x);
    default: return lanes_codes_avx2(bytes, gs, bits, u, x);
    }
}

#endif

/* dq_matvec's rows for any number of tokens (2..8 tokens: see dq_matvec). */
static __attribute__((noinline)) int matvec_rows(
    const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets, int64_t rows,
    int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m, float *y,
    int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    /* per token: the group sums of x, the row's 16 running lanes and its offsets' sum */
    float *xsum = malloc((size_t)(m * groups + m * LANES + m) * sizeof(float));
    if (!xsum) return -1;
    float *tot = xsum + m * groups, *off = tot + m * LANES;
    float q[MAX_GROUP];
    group_sums(x, m, groups, gs, padded_n, xsum);
    const group_unpacker unpack = make_group_unpacker(bits, portable);
#ifdef DQ_HAVE_AVX2
    const avx2_unpacker avx2 = make_avx2_unpacker(bits);
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = (const uint8_t *)(qweight + r * groups * words);
#ifdef DQ_HAVE_VBMI
        if (!portable && m == 1 && gs % 64 == 0) { /* decode: one token, lanes in registers */
            __m512 lanes = _mm512_setzero_ps();
            float o_sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *bytes = row + g * words * 4;
                prefetch_codes(bytes);
                const __m512 acc = lanes_codes_vbmi(bytes, gs, bits, &unpack.simd, x + g * gs);
                lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_set1_ps(bf16_value(scales[r * groups + g])), acc));
                o_sum += bf16_value(offsets[r * groups + g]) * xsum[g];
            }
            y[r] = lane_sum_zmm(lanes) + o_sum;
            continue;
        }
#elif defined(DQ_HAVE_AVX2)
        if (!portable && m == 1) { /* decode: one token, lanes in registers */
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            float o_sum = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *bytes = row + g * words * 4;
                prefetch_codes(bytes);
                const lanes16 acc = lanes_codes_avx2_bits(bytes, gs, bits, &avx2, x + g * gs);
                const __m256 s = _mm256_set1_ps(bf16_value(scales[r * groups + g]));
                lo = _mm256_add_ps(lo, _mm256_mul_ps(s, acc.lo));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(s, acc.hi));
                o_sum += bf16_value(offsets[r * groups + g]) * xsum[g];
            }
            y[r] = lane_sum_ymm2(lo, hi) + o_sum;
            continue;
        }
#endif
        for (int64_t i = 0; i < m * LANES; i++) tot[i] = 0.0f;
        for (int64_t t = 0; t < m; t++) off[t] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = row + g * words * 4;
            prefetch_codes(bytes);
            const float s = bf16_value(scales[r * groups + g]);
            const float o = bf16_value(offsets[r * groups + g]);
            unpack_codes_as_floats(&unpack, bytes, gs, q);
            for (int64_t t = 0; t < m; t++) {
                add_scaled_lanes(q, x + t * padded_n + g * gs, gs, s, tot + t * LANES);
                off[t] += o * xsum[t * groups + g];
            }
        }
        for (int64_t t = 0; t < m; t++) y[t * y_stride + r] = lane_sum(tot + t * LANES) + off[t];
    }
    free(xsum);
    return 0;
}

/* y [m, rows] (row stride y_stride) for the given block of rows; x [m, padded_n] float32 (zero
 * in the padding). portable != 0 forces the portable unpacking. Returns 0, or -1 if out of
 * memory or gs is unsupported. 2..8 tokens are faster through dq_matvec_tokens_mt
 * (packed_matvec_tokens.c, same bits), which Python calls first; a branch to it here would slow
 * the one-token loop (code placement). */
int dq_matvec(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              float *y, int64_t y_stride, int portable) {
    return matvec_rows(qweight, scales, offsets, rows, padded_n, gs, bits, x, m, y, y_stride,
                       portable);
}

/* dq_matvec with its rows split over `threads` threads (pool.c). */
int dq_matvec_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int64_t y_stride, int portable, int threads) {
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .rows = rows,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable, .x = x,
                      .m = m, .y = y, .y_stride = y_stride};
    return dq_parallel_rows(dq_matvec, &j, threads);
}

/* One token, the block's fixed arguments prepared once by the caller (unpack.h, dq_one_token).
 * Same product as dq_matvec_mt. */
int dq_matvec_one(const dq_packed_block *block, const float *x, float *y) {
    return dq_one_token(dq_matvec_mt, block, x, y);
}
