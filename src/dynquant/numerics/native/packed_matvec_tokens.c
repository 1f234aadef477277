/* The packed matvec (packed_matvec.c) for 2..8 tokens: each group's codes unpacked once, in
 * registers, for every token (VBMI: all tokens at once; AVX2: up to 4 tokens a pass, the 16 ymm
 * registers hold no more), each token's sums in registers. Same bits as packed_matvec.c. A file
 * of its own: compiled beside the one-token loop it slows that loop (the same source; code
 * placement). For the same reason it is reached only through its own entry,
 * dq_matvec_tokens_mt, called from Python (a branch to it inside dq_matvec slows the AVX2
 * one-token products; benchmarks/packed_products.py).
 */
#include "pool.h"
#include "unpack.h"

#ifdef DQ_HAVE_VBMI
/* Row r for M (2..8) tokens, codes and every sum in registers: each group's codes are unpacked
 * once for all tokens; token t's lane l sums j % 16 == l in order of j, exactly as
 * add_scaled_lanes does after unpacking to memory (unpacking once per token through memory
 * costs more than the products). One token keeps lanes_codes_vbmi: the general form runs it
 * slower. */
static inline __attribute__((always_inline)) void row_vbmi(
    const uint8_t *row, const uint16_t *scales, const uint16_t *offsets, int64_t groups,
    int64_t gs, int bits, const unpacker *u, const float *x, int64_t padded_n,
    const float *xsum, int M, float *y, int64_t y_stride) {
    const int64_t group_bytes = bits * gs / 8;
    __m512 tot[8];
    float o_sum[8];
    for (int t = 0; t < M; t++) tot[t] = _mm512_setzero_ps(), o_sum[t] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *bytes = row + g * group_bytes;
        prefetch_codes(bytes);
        __m512 acc[8];
        for (int t = 0; t < M; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t j = 0; j < gs; j += 64) {
            const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, 64, u);
            const __m512 q0 = DQ_PART(c, 0), q1 = DQ_PART(c, 1), q2 = DQ_PART(c, 2), q3 = DQ_PART(c, 3);
            for (int t = 0; t < M; t++) {
                const float *xt = x + t * padded_n + g * gs + j;
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(q0, _mm512_loadu_ps(xt)));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(q1, _mm512_loadu_ps(xt + 16)));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(q2, _mm512_loadu_ps(xt + 32)));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(q3, _mm512_loadu_ps(xt + 48)));
            }
        }
        const __m512 s = _mm512_set1_ps(bf16_value(scales[g]));
        const float o = bf16_value(offsets[g]);
        for (int t = 0; t < M; t++) {
            tot[t] = _mm512_add_ps(tot[t], _mm512_mul_ps(s, acc[t]));
            o_sum[t] += o * xsum[t * groups + g];
        }
    }
    for (int t = 0; t < M; t++) y[t * y_stride] = lane_sum_zmm(tot[t]) + o_sum[t];
}

/* row_vbmi with M (2..8) a constant (the sums stay in registers). */
static void row_vbmi_m(const uint8_t *row, const uint16_t *scales, const uint16_t *offsets,
                       int64_t groups, int64_t gs, int bits, const unpacker *u, const float *x,
                       int64_t padded_n, const float *xsum, int64_t m, float *y,
                       int64_t y_stride) {
#define DQ_ROW(M) row_vbmi(row, scales, offsets, groups, gs, bits, u, x, padded_n, xsum, M, y, y_stride)
    switch (m) {
    case 2: DQ_ROW(2); break;
    case 3: DQ_ROW(3); break;
    case 4: DQ_ROW(4); break;
    case 5: DQ_ROW(5); break;
    case 6: DQ_ROW(6); break;
    case 7: DQ_ROW(7); break;
    default: DQ_ROW(8);
    }
#undef DQ_ROW
}

#endif

#ifdef DQ_HAVE_AVX2
/* A row for M (1..4) tokens (x, xsum, tot and o_sum start at the pass's first token) with AVX2,
 * the width a constant: unit k (8 codes) of
 * a group is unpacked once for the M tokens and goes to lanes 8 * (k % 2) .. + 7, as in
 * packed_matvec.c's lanes_codes_avx2; each group's lanes are scaled and added to the token's
 * running lanes (tot, in memory: 4 tokens' accumulators fill the registers). */
static inline __attribute__((always_inline)) void row_avx2(
    const uint8_t *row, const uint16_t *scales, const uint16_t *offsets, int64_t groups,
    int64_t gs, int bits, const avx2_unpacker *u, const float *x, int64_t padded_n,
    const float *xsum, int M, float *tot, float *o_sum) {
    const int64_t group_bytes = bits * gs / 8;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *bytes = row + g * group_bytes;
        prefetch_codes(bytes);
        __m256 lo[4], hi[4];
        for (int t = 0; t < M; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int64_t k = 0; k < gs / 8; k += 2) {
            __m256 q0, q1;
            unit_pair_avx2(bytes, k, bits, group_bytes, u, &q0, &q1);
            for (int t = 0; t < M; t++) {
                const float *xt = x + t * padded_n + g * gs + 8 * k;
                lo[t] = _mm256_add_ps(lo[t], _mm256_mul_ps(q0, _mm256_loadu_ps(xt)));
                hi[t] = _mm256_add_ps(hi[t], _mm256_mul_ps(q1, _mm256_loadu_ps(xt + 8)));
            }
        }
        const __m256 s = _mm256_set1_ps(bf16_value(scales[g]));
        const float o = bf16_value(offsets[g]);
        for (int t = 0; t < M; t++) {
            float *tt = tot + t * LANES;
            _mm256_storeu_ps(tt, _mm256_add_ps(_mm256_loadu_ps(tt), _mm256_mul_ps(s, lo[t])));
            _mm256_storeu_ps(tt + 8, _mm256_add_ps(_mm256_loadu_ps(tt + 8), _mm256_mul_ps(s, hi[t])));
            o_sum[t] += o * xsum[t * groups + g];
        }
    }
}

/* row_avx2 with the width and M constants (codes at constant offsets; sums in registers). */
static void row_avx2_bm(const uint8_t *row, const uint16_t *scales, const uint16_t *offsets,
                        int64_t groups, int64_t gs, int bits, const avx2_unpacker *u,
                        const float *x, int64_t padded_n, const float *xsum, int M, float *tot,
                        float *o_sum) {
#define DQ_ROW(B, MM) row_avx2(row, scales, offsets, groups, gs, B, u, x, padded_n, xsum, MM, tot, o_sum)
#define DQ_WIDTHS(MM) switch (bits) { \
    case 2: DQ_ROW(2, MM); break; case 3: DQ_ROW(3, MM); break; case 4: DQ_ROW(4, MM); break; \
    case 8: DQ_ROW(8, MM); break; default: DQ_ROW(bits, MM); }
    switch (M) {
    case 1: DQ_WIDTHS(1); break;
    case 2: DQ_WIDTHS(2); break;
    case 3: DQ_WIDTHS(3); break;
    default: DQ_WIDTHS(4);
    }
#undef DQ_WIDTHS
#undef DQ_ROW
}

/* Row r for m (2..8) tokens: four tokens a pass over the row's codes, written to y[t * y_stride]. */
static void row_avx2_m(const uint8_t *row, const uint16_t *scales, const uint16_t *offsets,
                       int64_t groups, int64_t gs, int bits, const avx2_unpacker *u,
                       const float *x, int64_t padded_n, const float *xsum, int64_t m, float *y,
                       int64_t y_stride) {
    float tot[8 * LANES] = {0}, o_sum[8] = {0};
    for (int64_t t0 = 0; t0 < m; t0 += 4)
        row_avx2_bm(row, scales, offsets, groups, gs, bits, u, x + t0 * padded_n, padded_n,
                    xsum + t0 * groups, (int)(m - t0 < 4 ? m - t0 : 4), tot + t0 * LANES,
                    o_sum + t0);
    for (int64_t t = 0; t < m; t++)
        y[t * y_stride] = lane_sum_ymm2(_mm256_loadu_ps(tot + t * LANES),
                                        _mm256_loadu_ps(tot + t * LANES + 8)) + o_sum[t];
}
#endif

#if defined(DQ_HAVE_VBMI) || defined(DQ_HAVE_AVX2)
/* A block of rows for m tokens (dq_parallel_rows' signature: `portable` is never set here). */
static int tokens_rows(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                       int64_t m, float *y, int64_t y_stride, int portable) {
    (void)portable;
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (!xsum) return -1;
    group_sums(x, m, groups, gs, padded_n, xsum);
#ifdef DQ_HAVE_VBMI
    const unpacker u = make_unpacker(bits);
#define DQ_TOKENS_ROW row_vbmi_m
#else
    const avx2_unpacker u = make_avx2_unpacker(bits);
#define DQ_TOKENS_ROW row_avx2_m
#endif
    for (int64_t r = 0; r < rows; r++)
        DQ_TOKENS_ROW((const uint8_t *)(qweight + r * groups * words), scales + r * groups,
                      offsets + r * groups, groups, gs, bits, &u, x, padded_n, xsum, m, y + r,
                      y_stride);
#undef DQ_TOKENS_ROW
    free(xsum);
    return 0;
}

#endif

/* dq_matvec_mt for 2..8 tokens through this file's kernels, rows split over `threads` threads;
 * -2 (nothing done) where this build or group size has no few-token path: the caller then uses
 * dq_matvec_mt, which gives the same bits. */
int dq_matvec_tokens_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                        int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                        int64_t m, float *y, int64_t y_stride, int threads) {
#if defined(DQ_HAVE_VBMI)
    const int served = gs % 64 == 0;
#elif defined(DQ_HAVE_AVX2)
    const int served = gs % 32 == 0;
#else
    const int served = 0;
#endif
    if (!served || m < 2 || m > 8 || gs > MAX_GROUP) return -2;
#if defined(DQ_HAVE_VBMI) || defined(DQ_HAVE_AVX2)
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .rows = rows,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .x = x, .m = m, .y = y,
                      .y_stride = y_stride};
    return dq_parallel_rows(tokens_rows, &j, threads);
#else
    (void)qweight, (void)scales, (void)offsets, (void)rows, (void)padded_n, (void)bits, (void)x;
    (void)y, (void)y_stride, (void)threads;
    return -2;
#endif
}
