/* dynquant's packed vector-matrix product: y = x @ W for a matrix W [rows, padded_n] stored in
 * groups along its rows, i.e. along the *output* dimension (the expert banks of the reference
 * hybrid architecture, used as x @ W[e]), for a few tokens at a time, without materialising W:
 *   y[t, j] = sum_h (x[t, h] * scale[h, g(j)]) * q[h, j]  +  sum_h x[t, h] * offset[h, g(j)]
 * in float32, rows h in order; the offsets' part is one number per group, added at the end. Codes
 * are unpacked by unpack.h (VBMI, AVX2 or portable); on VBMI they stay in registers, and for
 * several tokens so do the sums of 64 outputs for up to 4 tokens across 64 rows at a time (one
 * token keeps the row-by-row loop, which streams from memory better than the blocked one).
 * Every path does the same float operations in the same order: bit-identical.
 */
#include "pool.h"
#include "unpack.h"

#ifdef DQ_HAVE_VBMI
/* Rows [h0, h1) of the codes part for 64 outputs (group g, offset j) and tn <= 4 tokens from t0,
 * the sums kept in registers across the rows (read from y and written back once): each output
 * still adds its rows' terms in order of h, exactly as the row-by-row loop below does, so the
 * bits are the same; that loop read and wrote y for every row. */
static inline __attribute__((always_inline)) void block64_rows(
    const uint32_t *qweight, const uint16_t *scales, int64_t rows, int64_t groups, int64_t gs,
    int bits, const unpacker *u, const float *x, int64_t t0, int tn, int64_t g, int64_t j,
    int64_t h0, int64_t h1, float *y, int64_t y_stride) {
    const int64_t words = bits * gs / 32;
    __m512 acc[4][4];
    for (int t = 0; t < tn; t++)
        for (int p = 0; p < 4; p++) acc[t][p] = _mm512_loadu_ps(y + (t0 + t) * y_stride + g * gs + j + 16 * p);
    for (int64_t h = h0; h < h1; h++) {
        const uint8_t *bytes = (const uint8_t *)(qweight + (h * groups + g) * words) + j * bits / 8;
        const __m512i c = unpack_codes64(bytes, bits, 64, u);
        const __m512 q0 = DQ_PART(c, 0), q1 = DQ_PART(c, 1), q2 = DQ_PART(c, 2), q3 = DQ_PART(c, 3);
        const float s = bf16_value(scales[h * groups + g]);
        for (int t = 0; t < tn; t++) {
            const __m512 xs = _mm512_set1_ps(x[(t0 + t) * rows + h] * s);
            acc[t][0] = _mm512_add_ps(acc[t][0], _mm512_mul_ps(xs, q0));
            acc[t][1] = _mm512_add_ps(acc[t][1], _mm512_mul_ps(xs, q1));
            acc[t][2] = _mm512_add_ps(acc[t][2], _mm512_mul_ps(xs, q2));
            acc[t][3] = _mm512_add_ps(acc[t][3], _mm512_mul_ps(xs, q3));
        }
    }
    for (int t = 0; t < tn; t++)
        for (int p = 0; p < 4; p++) _mm512_storeu_ps(y + (t0 + t) * y_stride + g * gs + j + 16 * p, acc[t][p]);
}

/* Rows of VBMI_ROW_CHUNK at a time (their codes stay in L1 while every 64 outputs take their
 * turn), groups [g0, g1), tokens four at a time. */
#define VBMI_ROW_CHUNK 64
static void codes_part_vbmi(const uint32_t *qweight, const uint16_t *scales, int64_t rows,
                            int64_t groups, int64_t gs, int bits, const float *x, int64_t m,
                            int64_t g0, int64_t g1, float *y, int64_t y_stride) {
    const unpacker u = make_unpacker(bits);
    const int64_t row_bytes = groups * (bits * gs / 32) * 4;
    for (int64_t h0 = 0; h0 < rows; h0 += VBMI_ROW_CHUNK) {
        const int64_t h1 = h0 + VBMI_ROW_CHUNK < rows ? h0 + VBMI_ROW_CHUNK : rows;
        /* the chunk's rows are contiguous: fetch the next chunk while this one is worked on
         * (its passes read each row a few bytes at a time, which the hardware prefetcher does
         * not follow, so from memory this loop would wait on every row; one token still takes
         * the row loop below) */
        const int64_t h2 = h1 + VBMI_ROW_CHUNK < rows ? h1 + VBMI_ROW_CHUNK : rows;
        const uint8_t *next = (const uint8_t *)qweight + h1 * row_bytes;
        for (int64_t b = 0; b < (h2 - h1) * row_bytes; b += 64) __builtin_prefetch(next + b, 0, 3);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t j = 0; j < gs; j += 64)
                for (int64_t t0 = 0; t0 < m; t0 += 4) {
                    const int tn = m - t0 < 4 ? (int)(m - t0) : 4;
                    switch (tn) { /* constant token counts: the accumulators stay in registers */
                    case 1: block64_rows(qweight, scales, rows, groups, gs, bits, &u, x, t0, 1, g, j, h0, h1, y, y_stride); break;
                    case 2: block64_rows(qweight, scales, rows, groups, gs, bits, &u, x, t0, 2, g, j, h0, h1, y, y_stride); break;
                    case 3: block64_rows(qweight, scales, rows, groups, gs, bits, &u, x, t0, 3, g, j, h0, h1, y, y_stride); break;
                    default: block64_rows(qweight, scales, rows, groups, gs, bits, &u, x, t0, 4, g, j, h0, h1, y, y_stride);
                    }
                }
    }
}
#endif

/* The codes part of rows [0, rows) for groups [g0, g1) into y (zeroed first). */
static void codes_part(const uint32_t *qweight, const uint16_t *scales, int64_t rows,
                       int64_t groups, int64_t gs, int bits, const float *x, int64_t m,
                       int64_t g0, int64_t g1, float *y, int64_t y_stride, int portable) {
    const int64_t words = bits * gs / 32;
#ifdef DQ_HAVE_VBMI
    if (!portable && gs % 64 == 0 && m > 1) { /* one token: the row-by-row loop streams better */
        codes_part_vbmi(qweight, scales, rows, groups, gs, bits, x, m, g0, g1, y, y_stride);
        return;
    }
#endif
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
