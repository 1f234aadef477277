/* dynquant's packed vector-matrix product: y = x @ W for a matrix W [rows, padded_n] stored in
 * groups along its rows, i.e. along the *output* dimension (the expert banks of the reference
 * hybrid architecture, used as x @ W[e]), for a few tokens at a time, without materialising W:
 *   y[t, j] = sum_h (x[t, h] * scale[h, g(j)]) * q[h, j] + x[t, h] * offset[h, g(j)]
 * in float32, rows h in order. Codes are unpacked by unpack.h (AVX-512 VBMI where the CPU has
 * it, else the portable path; both give the same floats, so the results are bit-identical).
 */
#include "unpack.h"

int dq_vecmat(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    float q[MAX_GROUP];
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = g0 * gs; j < g1 * gs; j++) y[t * padded_n + j] = 0.0f;
    for (int64_t h = 0; h < rows; h++) {
        for (int64_t g = g0; g < g1; g++) {
            unpack_codes_as_floats(&unpack, (const uint8_t *)(qweight + (h * groups + g) * words),
                                   gs, q);
            const float s = bf16_value(scales[h * groups + g]);
            const float o = bf16_value(offsets[h * groups + g]);
            for (int64_t t = 0; t < m; t++) {
                const float xs = x[t * rows + h] * s, xo = x[t * rows + h] * o;
                float *yt = y + t * padded_n + g * gs;
                for (int64_t j = 0; j < gs; j++) yt[j] += xs * q[j] + xo;
            }
        }
    }
    return 0;
}
