/* dynquant's fast quantizer: the clip search and the codes of whole rows, one group at a time.
 *
 * It computes exactly what numerics/quantizer.py's torch path computes, per group of `gs` values
 * along a row (the last group may be shorter: its padding is code 0 and weighs nothing):
 *   for each alpha:  lo = mn * alpha, hi = mx * alpha (float32)
 *                    scale = bf16((hi - lo) / max_code), offset = bf16(lo)
 *                    x = (w - offset) / scale,  q = clamp(round_half_even(x), 0, max_code)
 *                    err = scale^2 * sum (q - x)^2 * importance   (sum (w - offset)^2 * importance
 *                                                                    when scale == 0)
 *   the first alpha with the least error wins; its codes (packed as format/packing.py says),
 *   scale and offset are written.
 * Build flags must keep IEEE semantics: no -ffast-math, and -ffp-contract=off (no fused
 * multiply-adds), so that every value is the float32 result of the operations as written. The sums
 * run in LANES independent partial sums combined by lane_sum, the order the format fixes (docs/
 * format.md), so the torch path and the reference resolve near-ties alike; it does not depend on
 * the vector width the compiler picks.
 */
#include <math.h>

#include "unpack.h" /* LANES, MAX_GROUP, bf16 conversions, lane_sum: the format's summation order */

/* (v + 1.5 * 2^23) - 1.5 * 2^23 rounds v to the nearest integer, ties to even, for |v| < 2^22. */
#define ROUND_MAGIC 12582912.0f

static inline float round_bf16(float x) { return bf16_value(bf16_round(x)); }

static inline float clamp_round(float x, float max_code) {
    /* round(clamp(x, 0, M)) == clamp(round(x), 0, M) for integer bounds; clamping first keeps
       the magic-number rounding in its exact range. The comparisons are written as x86's
       max/min instructions define them, so they compile to one instruction each. */
    float c = x > 0.0f ? x : 0.0f;
    c = c < max_code ? c : max_code;
    return (c + ROUND_MAGIC) - ROUND_MAGIC;
}

/* sum over j of (clamp(round(x)) - x)^2 [* imp[j]], x = (w[j] - offset) / scale, into acc:
 * value j goes to partial sum j % LANES. */
static inline void code_error_sums(const float *w, const float *imp, int64_t len, float scale,
                                   float offset, float max_code, float *acc) {
    const int64_t full = len - len % LANES;
    for (int64_t j = 0; j < full; j += LANES) {
        for (int l = 0; l < LANES; l++) {
            float x = (w[j + l] - offset) / scale;
            float d = clamp_round(x, max_code) - x;
            acc[l] += imp ? (d * d) * imp[j + l] : d * d;
        }
    }
    for (int64_t j = full; j < len; j++) {
        float x = (w[j] - offset) / scale;
        float d = clamp_round(x, max_code) - x;
        acc[j % LANES] += imp ? (d * d) * imp[j] : d * d;
    }
}

/* Weighted squared error of one group for one (scale, offset). */
static float group_error(const float *w, const float *imp, int64_t len, float scale, float offset,
                         float max_code) {
    float acc[LANES] = {0};
    if (scale == 0.0f) { /* constant group: every code is 0, w_hat = offset */
        for (int64_t j = 0; j < len; j++) {
            float d = w[j] - offset;
            acc[j % LANES] += imp ? (d * d) * imp[j] : d * d;
        }
        return lane_sum(acc);
    }
    /* two copies of the loop, so that neither tests imp per value */
    if (imp)
        code_error_sums(w, imp, len, scale, offset, max_code, acc);
    else
        code_error_sums(w, NULL, len, scale, offset, max_code, acc);
    return lane_sum(acc) * (scale * scale);
}

/* code j of a group occupies stream bits [j*bits, (j+1)*bits), LSB first in little-endian
 * 32-bit words (format/packing.py); bits * gs is a multiple of 32, so no bits are left over.
 * 8 codes fill exactly `bits` bytes: the loop packs 8-code units with constant shifts. */
static inline void pack_units(const uint8_t *codes, int64_t gs, int bits, uint8_t *out) {
    for (int64_t j = 0; j < gs; j += 8, out += bits) {
        uint64_t unit = 0;
        for (int i = 0; i < 8; i++) unit |= (uint64_t)codes[j + i] << (i * bits);
        for (int b = 0; b < bits; b++) out[b] = (uint8_t)(unit >> (8 * b));
    }
}

static void pack_group(const uint8_t *codes, int64_t gs, int bits, uint32_t *out) {
    uint8_t *bytes = (uint8_t *)out; /* little-endian: the stream is the words' byte sequence */
    switch (bits) { /* one specialised copy per width */
    case 2: pack_units(codes, gs, 2, bytes); break;
    case 3: pack_units(codes, gs, 3, bytes); break;
    case 4: pack_units(codes, gs, 4, bytes); break;
    case 5: pack_units(codes, gs, 5, bytes); break;
    case 6: pack_units(codes, gs, 6, bytes); break;
    case 8: memcpy(bytes, codes, (size_t)gs); break;
    default: pack_units(codes, gs, bits, bytes);
    }
}

/* Min and max of a group, lane-wise then combined; 0 if a value is not finite (v * 0 is NaN
 * exactly for inf and NaN, and NaN survives the sums). */
static int min_max(const float *g, int64_t len, float *mn_out, float *mx_out) {
    float mn[LANES], mx[LANES], nonfinite[LANES] = {0};
    const int64_t full = len - len % LANES;
    for (int l = 0; l < LANES; l++) mn[l] = mx[l] = g[0];
    for (int64_t j = 0; j < full; j += LANES) {
        for (int l = 0; l < LANES; l++) {
            mn[l] = g[j + l] < mn[l] ? g[j + l] : mn[l];
            mx[l] = g[j + l] > mx[l] ? g[j + l] : mx[l];
            nonfinite[l] += g[j + l] * 0.0f;
        }
    }
    for (int64_t j = full; j < len; j++) {
        mn[0] = g[j] < mn[0] ? g[j] : mn[0];
        mx[0] = g[j] > mx[0] ? g[j] : mx[0];
        nonfinite[0] += g[j] * 0.0f;
    }
    float lo = mn[0], hi = mx[0], check = 0.0f;
    for (int l = 0; l < LANES; l++) {
        lo = mn[l] < lo ? mn[l] : lo;
        hi = mx[l] > hi ? mx[l] : hi;
        check += nonfinite[l];
    }
    *mn_out = lo;
    *mx_out = hi;
    return check == 0.0f;
}

static void load_group(const void *rows, int is_bf16, int64_t at, int64_t len, float *g) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)rows + at;
        for (int64_t j = 0; j < len; j++) g[j] = bf16_value(src[j]);
    } else {
        memcpy(g, (const float *)rows + at, (size_t)len * sizeof(float));
    }
}

/* Quantize rows [rows, n] (row-major float32, or bfloat16 when is_bf16) in groups of gs <=
 * MAX_GROUP along each row. Writes, per row, the packed codes qweight [groups * bits * gs / 32]
 * (padding codes 0), and per group the bf16 scale and offset, the index of the chosen alpha, its
 * error and the error of alphas[0]. Returns 0, or -1 if a value is not finite. */
int dq_quantize_rows(const void *w, int is_bf16, int64_t rows, int64_t n, int64_t gs, int bits,
                     const float *alphas, int n_alphas, const float *importance, uint32_t *qweight,
                     uint16_t *scales, uint16_t *offsets, uint8_t *chosen, float *chosen_err,
                     float *first_err) {
    const float max_code = (float)((1 << bits) - 1);
    const int64_t groups = (n + gs - 1) / gs, words = bits * gs / 32;
    float g[MAX_GROUP];
    uint8_t codes[MAX_GROUP];
    if (gs > MAX_GROUP) return -2;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < groups; k++) {
            const float *imp = importance ? importance + k * gs : NULL;
            const int64_t len = (k + 1) * gs <= n ? gs : n - k * gs, at = r * groups + k;
            load_group(w, is_bf16, r * n + k * gs, len, g);
            float mn, mx;
            if (!min_max(g, len, &mn, &mx)) return -1;
            int best = 0;
            float best_err = 0.0f, best_scale = 0.0f, best_offset = 0.0f;
            for (int i = 0; i < n_alphas; i++) {
                const float lo = mn * alphas[i], hi = mx * alphas[i];
                const float scale = round_bf16((hi - lo) / max_code), offset = round_bf16(lo);
                const float err = group_error(g, imp, len, scale, offset, max_code);
                if (i == 0) first_err[at] = err;
                if (i == 0 || err < best_err) {
                    best = i;
                    best_err = err;
                    best_scale = scale;
                    best_offset = offset;
                }
            }
            for (int64_t j = 0; j < len; j++) {
                codes[j] = best_scale == 0.0f
                               ? 0
                               : (uint8_t)clamp_round((g[j] - best_offset) / best_scale, max_code);
            }
            for (int64_t j = len; j < gs; j++) codes[j] = 0;
            pack_group(codes, gs, bits, qweight + at * words);
            scales[at] = bf16_round(best_scale); /* exact: already bf16 values */
            offsets[at] = bf16_round(best_offset);
            chosen[at] = (uint8_t)best;
            chosen_err[at] = best_err;
        }
    }
    return 0;
}
