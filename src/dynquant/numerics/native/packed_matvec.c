/* dynquant's packed matrix-vector product: y = x @ W^T straight from the packed format, for a few
 * tokens at a time (decode), without materialising W.
 *
 * W is [rows, padded_n] in groups of gs along each row, w = q * scale + offset with bf16
 * scale/offset:
 *   y[t, r] = sum_g scale[r, g] * (q[r, g, :] . x[t, g, :]) + offset[r, g] * sum(x[t, g, :])
 * in float32. A group is unpacked once (unpack.h: AVX-512 VBMI, AVX2 or portable) and its dot
 * products with every token summed in 16 lane-wise partial sums combined as a fixed tree: every
 * unpack path gives bit-identical results.
 */
#include "unpack.h"

static inline float dot(const float *q, const float *x, int64_t gs) {
    float acc[LANES] = {0};
    for (int64_t j = 0; j < gs; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += q[j + l] * x[j + l];
    return lane_sum(acc);
}

int dq_matvec_has_simd(void) { return dq_has_simd(); }

#ifdef DQ_HAVE_VBMI
/* dot(codes of a group, x) for one token, codes kept in registers: lane l sums j % 16 == l in
 * order of j and lane_sum combines them, exactly as dot() does after unpacking to memory. */
static inline float dot_codes_vbmi(const uint8_t *bytes, int64_t gs, int bits, const unpacker *u,
                                   const float *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < gs; j += 64) {
        const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, 64, u);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 0), _mm512_loadu_ps(x + j)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 1), _mm512_loadu_ps(x + j + 16)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 2), _mm512_loadu_ps(x + j + 32)));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(DQ_PART(c, 3), _mm512_loadu_ps(x + j + 48)));
    }
    return lane_sum_zmm(acc);
}
#endif

/* y [m, rows] (row stride y_stride) for the given block of rows; x [m, padded_n] float32 (zero
 * in the padding). portable != 0 forces the portable unpacking. Returns 0, or -1 if out of
 * memory or gs is unsupported. */
int dq_matvec(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (!xsum) return -1;
    float ones[MAX_GROUP], q[MAX_GROUP];
    for (int64_t j = 0; j < gs; j++) ones[j] = 1.0f;
    for (int64_t t = 0; t < m; t++)
        for (int64_t g = 0; g < groups; g++) xsum[t * groups + g] = dot(ones, x + t * padded_n + g * gs, gs);
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t = 0; t < m; t++) y[t * y_stride + r] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *bytes = (const uint8_t *)(qweight + (r * groups + g) * words);
            const float s = bf16_value(scales[r * groups + g]);
            const float o = bf16_value(offsets[r * groups + g]);
#ifdef DQ_HAVE_VBMI
            if (!portable && m == 1 && gs % 64 == 0) { /* decode: one token */
                y[r] += s * dot_codes_vbmi(bytes, gs, bits, &unpack.simd, x + g * gs) + o * xsum[g];
                continue;
            }
#endif
            unpack_codes_as_floats(&unpack, bytes, gs, q);
            for (int64_t t = 0; t < m; t++)
                y[t * y_stride + r] += s * dot(q, x + t * padded_n + g * gs, gs) + o * xsum[t * groups + g];
        }
    }
    free(xsum);
    return 0;
}
