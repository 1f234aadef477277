/* The packed matvec (packed_matvec.c) for 2..8 tokens with VBMI: each group's codes unpacked
 * once, in registers, for every token, and every token's sums in registers. A file of its own:
 * compiled beside the one-token loop, it slowed that loop by ~10% (the same source; code
 * placement). An AVX2 form (3 tokens a pass in 16 ymm: 2 tokens 222 -> 132 us) was left out:
 * dispatching to it slowed the AVX2 build's one-token products by ~15% in the same way.
 */
#include "unpack.h"

#ifdef DQ_HAVE_VBMI
/* Row r for M (2..8) tokens, codes and every sum in registers: each group's codes are unpacked
 * once for all tokens; token t's lane l sums j % 16 == l in order of j, exactly as
 * add_scaled_lanes does after unpacking to memory. 1152 x 1024, 3-bit, one thread: 2 / 4 / 8
 * tokens 217 / 331 / 560 -> 86 / 130 / 218 us (through memory, 2 tokens took 3.6x one token's
 * time). One token keeps lanes_codes_vbmi: the general form ran it ~10% slower. */
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

int dq_matvec_tokens(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                     int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                     int64_t m, float *y, int64_t y_stride) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (!xsum) return -1;
    group_sums(x, m, groups, gs, padded_n, xsum);
    const unpacker u = make_unpacker(bits);
    for (int64_t r = 0; r < rows; r++)
        row_vbmi_m((const uint8_t *)(qweight + r * groups * words), scales + r * groups,
                   offsets + r * groups, groups, gs, bits, &u, x, padded_n, xsum, m, y + r,
                   y_stride);
    free(xsum);
    return 0;
}
#endif
