/* dynquant's native dequantization: w = q * scale + offset (float32: a multiply, then an add, as
 * numerics/quantizer.py's dequantize_rows computes it), written as float32 or rounded to bfloat16
 * (nearest, ties to even, as torch's conversion), with the group padding dropped. Bit-identical to
 * the torch path; several times faster (codes unpacked by unpack.h, one pass over the output).
 */
#include "unpack.h"

static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* out [rows, n] (float32 if out_bf16 == 0, else bfloat16) from rows of groups of gs codes. */
int dq_dequantize_rows(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t n, int64_t gs, int bits, void *out, int out_bf16,
                       int portable) {
    const int64_t groups = (n + gs - 1) / gs, words = bits * gs / 32;
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    float q[MAX_GROUP];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            unpack_codes_as_floats(&unpack, (const uint8_t *)(qweight + (r * groups + g) * words),
                                   gs, q);
            const float s = bf16_value(scales[r * groups + g]);
            const float o = bf16_value(offsets[r * groups + g]);
            const int64_t len = (g + 1) * gs <= n ? gs : n - g * gs;
            if (out_bf16) {
                uint16_t *dst = (uint16_t *)out + r * n + g * gs;
                for (int64_t j = 0; j < len; j++) dst[j] = bf16_round(q[j] * s + o);
            } else {
                float *dst = (float *)out + r * n + g * gs;
                for (int64_t j = 0; j < len; j++) dst[j] = q[j] * s + o;
            }
        }
    }
    return 0;
}
