/* dynquant's native dequantization: w = q * scale + offset (float32: a multiply, then an add, as
 * numerics/quantizer.py's dequantize_rows computes it), written as float32 or rounded to bfloat16
 * (nearest, ties to even, as torch's conversion), with the group padding dropped. Bit-identical to
 * the torch path; several times faster (codes unpacked by unpack.h, one pass over the output).
 */
#include "pool.h"
#include "unpack.h"

#ifdef DQ_HAVE_VBMI
/* bf16_round of 16 floats at once, with the same integer arithmetic (so the same bits). */
static inline __m256i bf16_round16_int(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

#ifdef __AVX512BF16__
/* The same with the CPU's conversion (VCVTNEPS2BF16: nearest, ties to even, NaNs quietened as
 * bf16_round does) in one instruction instead of ~8. It flushes denormal inputs to zero, so a vector
 * holding one takes the integer path (the same bits: tests/numerics/test_packed_matvec.py). */
static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 denormal = _mm512_mask_cmplt_epu32_mask(
        _mm512_test_epi32_mask(u, u), u, _mm512_set1_epi32(0x00800000));
    if (denormal) return bf16_round16_int(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}
#else
#define bf16_round16 bf16_round16_int
#endif

/* One whole group (gs a multiple of 64) to bf16: codes stay in registers. */
static inline void group_to_bf16_vbmi(const uint8_t *bytes, int64_t gs, int bits,
                                      const unpacker *u, float s, float o, uint16_t *dst) {
    const __m512 vs = _mm512_set1_ps(s), vo = _mm512_set1_ps(o);
    for (int64_t j = 0; j < gs; j += 64) {
        const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, 64, u);
        _mm256_storeu_si256((__m256i *)(dst + j), bf16_round16(_mm512_add_ps(_mm512_mul_ps(DQ_PART(c, 0), vs), vo)));
        _mm256_storeu_si256((__m256i *)(dst + j + 16), bf16_round16(_mm512_add_ps(_mm512_mul_ps(DQ_PART(c, 1), vs), vo)));
        _mm256_storeu_si256((__m256i *)(dst + j + 32), bf16_round16(_mm512_add_ps(_mm512_mul_ps(DQ_PART(c, 2), vs), vo)));
        _mm256_storeu_si256((__m256i *)(dst + j + 48), bf16_round16(_mm512_add_ps(_mm512_mul_ps(DQ_PART(c, 3), vs), vo)));
    }
}
#endif

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
            const uint8_t *bytes = (const uint8_t *)(qweight + (r * groups + g) * words);
            prefetch_codes(bytes);
            const float s = bf16_value(scales[r * groups + g]);
            const float o = bf16_value(offsets[r * groups + g]);
            const int64_t len = (g + 1) * gs <= n ? gs : n - g * gs;
#ifdef DQ_HAVE_VBMI
            if (out_bf16 && !portable && len == gs && gs % 64 == 0) {
                group_to_bf16_vbmi(bytes, gs, bits, &unpack.simd, s, o, (uint16_t *)out + r * n + g * gs);
                continue;
            }
#endif
            unpack_codes_as_floats(&unpack, bytes, gs, q);
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

/* dq_dequantize_rows with its rows split over `threads` threads (pool.c): a part reaches a
 * waiting worker within a microsecond, where a Python pool's hand-off costs about half of a
 * seed expert's (1152 x 1024) dequantization. */
typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t n, gs;
    int bits, out_bf16, portable;
    void *out;
} dequant_job;

static int dequant_part(const void *ctx, int64_t lo, int64_t hi) {
    const dequant_job *j = ctx;
    const int64_t groups = (j->n + j->gs - 1) / j->gs, words = j->bits * j->gs / 32;
    char *out = (char *)j->out + lo * j->n * (j->out_bf16 ? 2 : 4);
    return dq_dequantize_rows(j->qweight + lo * groups * words, j->scales + lo * groups,
                              j->offsets + lo * groups, hi - lo, j->n, j->gs, j->bits, out,
                              j->out_bf16, j->portable);
}

int dq_dequantize_rows_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                          int64_t rows, int64_t n, int64_t gs, int bits, void *out, int out_bf16,
                          int portable, int threads) {
    const dequant_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .n = n,
                           .gs = gs, .bits = bits, .out_bf16 = out_bf16, .portable = portable,
                           .out = out};
    return dq_parallel(dequant_part, &j, rows, threads);
}
