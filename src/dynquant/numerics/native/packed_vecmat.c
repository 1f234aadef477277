/* dynquant's packed vector-matrix product: y = x @ W for a matrix W [rows, padded_n] stored in
 * groups along its rows, i.e. along the *output* dimension (the expert banks of the reference
 * hybrid architecture, used as x @ W[e]), for a few tokens at a time, without materialising W:
 *   y[t, j] = sum_h (x[t, h] * scale[h, g(j)]) * q[h, j]  +  sum_h x[t, h] * offset[h, g(j)]
 * in float32, rows h in order; the offsets' part is one number per group, added at the end. Codes
 * are unpacked by unpack.h (VBMI, AVX2 or portable); for one token on VBMI they stay in
 * registers. Every path does the same float operations in the same order: bit-identical.
 */
#include "pool.h"
#include "unpack.h"

/* The codes part of rows [0, rows) for groups [g0, g1) into y (zeroed first). */
static void codes_part(const uint32_t *qweight, const uint16_t *scales, int64_t rows,
                       int64_t groups, int64_t gs, int bits, const float *x, int64_t m,
                       int64_t g0, int64_t g1, float *y, int64_t y_stride, int portable) {
    const int64_t words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    float q[MAX_GROUP];
    for (int64_t h = 0; h < rows; h++) {
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *bytes = (const uint8_t *)(qweight + (h * groups + g) * words);
            prefetch_codes(bytes);
            const float s = bf16_value(scales[h * groups + g]);
#ifdef DQ_HAVE_VBMI
            if (!portable && m == 1 && gs % 64 == 0) { /* decode: one token, parts unrolled */
                const __m512 xs = _mm512_set1_ps(x[h] * s);
                float *yg = y + g * gs;
                for (int64_t j = 0; j < gs; j += 64) {
                    const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, 64, &unpack.simd);
                    float *yj = yg + j;
                    _mm512_storeu_ps(yj, _mm512_add_ps(_mm512_loadu_ps(yj), _mm512_mul_ps(xs, DQ_PART(c, 0))));
                    _mm512_storeu_ps(yj + 16, _mm512_add_ps(_mm512_loadu_ps(yj + 16), _mm512_mul_ps(xs, DQ_PART(c, 1))));
                    _mm512_storeu_ps(yj + 32, _mm512_add_ps(_mm512_loadu_ps(yj + 32), _mm512_mul_ps(xs, DQ_PART(c, 2))));
                    _mm512_storeu_ps(yj + 48, _mm512_add_ps(_mm512_loadu_ps(yj + 48), _mm512_mul_ps(xs, DQ_PART(c, 3))));
                }
                continue;
            }
#endif
            unpack_codes_as_floats(&unpack, bytes, gs, q);
            for (int64_t t = 0; t < m; t++) {
                const float xs = x[t * rows + h] * s;
                float *yt = y + t * y_stride + g * gs;
                for (int64_t j = 0; j < gs; j++) yt[j] = yt[j] + xs * q[j];
            }
        }
    }
}

int dq_vecmat(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable) {
    const int64_t groups = padded_n / gs;
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = g0 * gs; j < g1 * gs; j++) y[t * padded_n + j] = 0.0f;
    codes_part(qweight, scales, rows, groups, gs, bits, x, m, g0, g1, y, padded_n, portable);
    for (int64_t t = 0; t < m; t++)
        for (int64_t g = g0; g < g1; g++) {
            float off = 0.0f; /* sum_h x[t, h] * offset[h, g], rows in order */
            for (int64_t h = 0; h < rows; h++) off += x[t * rows + h] * bf16_value(offsets[h * groups + g]);
            float *yt = y + t * padded_n + g * gs;
            for (int64_t j = 0; j < gs; j++) yt[j] += off;
        }
    return 0;
}

/* dq_vecmat with its groups split over `threads` threads (pool.c). */
int dq_vecmat_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int portable, int threads) {
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .rows = rows,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable, .x = x,
                      .m = m, .y = y};
    return dq_parallel_groups(dq_vecmat, &j, threads);
}
