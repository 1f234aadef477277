/* dynquant's native tunable dequantize (numerics/tuned_scales.py): a tensor's codes as bytes q
 * (uint8 [rows, groups, gs]) with float32 group scales s and offsets o [rows, groups], each step
 * of a block's tuning:
 *   forward   w[r, g, j] = q * s[r, g] + o[r, g]          (multiply, then add: the format's);
 *   backward  gs[r, g] = sum_j grad[r, g, j] * q[r, g, j],  go[r, g] = sum_j grad[r, g, j]
 *             (grad float32 or bf16, which is read as it is: a block's bf16 pass's gradients),
 * each sum in a fixed order: 16 lanes from +0, lane l adding values l, l + 16, l + 32, ... in
 * order, then lane l + 8 added to lane l, l + 4 to l, l + 2 to l, l + 1 to l (gs a multiple of
 * 16). The torch path (tuned_scales.group_sums_torch) takes the same float32 operations in the
 * same order, bit for bit; here each is one pass over the codes and the gradient where torch
 * takes several (the codes widened to float, the product, two sums), their rows split over the
 * threads. */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "pool.h"
#include "unpack.h" /* bf16_round, group_unpacker */

#define LANES 16

typedef struct {
    const uint8_t *q;
    const float *s, *o, *grad;
    const uint16_t *grad16; /* the backward's gradient in bf16 instead of grad */
    float *w, *grad_s, *grad_o;
    uint16_t *w16; /* the forward's output in bf16 instead of w */
    int64_t groups, gs;
} tunable_job;

static int forward_part(const void *ctx, int64_t lo, int64_t hi) {
    const tunable_job *j = ctx;
    if (j->w16) { /* float32, then to nearest bf16 (ties to even: torch's conversion) */
        for (int64_t k = lo * j->groups; k < hi * j->groups; k++) {
            const uint8_t *restrict q = j->q + k * j->gs;
            uint16_t *restrict w = j->w16 + k * j->gs;
            const float s = j->s[k], o = j->o[k];
            for (int64_t i = 0; i < j->gs; i++) w[i] = bf16_round((float)q[i] * s + o);
        }
        return 0;
    }
#if defined(__AVX2__)
    /* The weights (4 bytes each, a block's ~1 GB at 7B shapes, read later by its products) go
     * to memory past the caches: stored without first reading their lines in (non-temporal), a
     * third less traffic. The same values: multiply, then add. */
    if ((uintptr_t)j->w % 32 == 0 && j->gs % 8 == 0) {
        for (int64_t k = lo * j->groups; k < hi * j->groups; k++) {
            const uint8_t *q = j->q + k * j->gs;
            float *w = j->w + k * j->gs;
            const __m256 s = _mm256_set1_ps(j->s[k]), o = _mm256_set1_ps(j->o[k]);
            for (int64_t i = 0; i < j->gs; i += 8) {
                const __m256 v = _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
                _mm256_stream_ps(w + i, _mm256_add_ps(_mm256_mul_ps(v, s), o));
            }
        }
        _mm_sfence(); /* the stores visible before the part is counted done */
        return 0;
    }
#endif
    for (int64_t k = lo * j->groups; k < hi * j->groups; k++) {
        const uint8_t *restrict q = j->q + k * j->gs;
        float *restrict w = j->w + k * j->gs;
        const float s = j->s[k], o = j->o[k];
        for (int64_t i = 0; i < j->gs; i++) w[i] = (float)q[i] * s + o;
    }
    return 0;
}

static inline float fold_lanes(float *a) {
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) a[l] = a[l] + a[l + h];
    return a[0];
}

/* One group's two sums into a[LANES] (times) and b[LANES] (plain), lanes not yet folded, of a
 * gradient in float32 (g) or bf16 (g16: each value widened exactly, so the same sums bit for
 * bit). AVX2: the 16 lanes in two registers each (GCC 12 turns a vector-extension
 * byte-to-float conversion into scalar code); the same adds in the same order as the plain
 * loop. */
#if defined(__AVX2__)
static inline __m256 load_gradient(const float *g, const uint16_t *g16, int64_t k) {
    if (!g16) return _mm256_loadu_ps(g + k);
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g16 + k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#endif

static inline void group_lanes(const float *g, const uint16_t *g16, const uint8_t *q,
                               int64_t gs, float *a, float *b) {
#if defined(__AVX2__)
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, p0 = t0, p1 = t0;
    for (int64_t k = 0; k < gs; k += LANES) {
        const __m256 x0 = load_gradient(g, g16, k), x1 = load_gradient(g, g16, k + 8);
        const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(q + k))));
        const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(q + k + 8))));
        t0 = _mm256_add_ps(t0, _mm256_mul_ps(x0, c0));
        t1 = _mm256_add_ps(t1, _mm256_mul_ps(x1, c1));
        p0 = _mm256_add_ps(p0, x0);
        p1 = _mm256_add_ps(p1, x1);
    }
    _mm256_storeu_ps(a, t0);
    _mm256_storeu_ps(a + 8, t1);
    _mm256_storeu_ps(b, p0);
    _mm256_storeu_ps(b + 8, p1);
#else
    for (int l = 0; l < LANES; l++) a[l] = b[l] = 0.0f;
    for (int64_t k = 0; k < gs; k += LANES)
        for (int l = 0; l < LANES; l++) {
            const float x = g16 ? bf16_value(g16[k + l]) : g[k + l];
            a[l] += x * (float)q[k + l];
            b[l] += x;
        }
#endif
}

static int backward_part(const void *ctx, int64_t lo, int64_t hi) {
    const tunable_job *j = ctx;
    for (int64_t k = lo * j->groups; k < hi * j->groups; k++) {
        float a[LANES], b[LANES];
        group_lanes(j->grad16 ? NULL : j->grad + k * j->gs,
                    j->grad16 ? j->grad16 + k * j->gs : NULL, j->q + k * j->gs, j->gs, a, b);
        j->grad_s[k] = fold_lanes(a);
        j->grad_o[k] = fold_lanes(b);
    }
    return 0;
}

/* group_lanes of codes unpacked to floats (the same values as the bytes widened): the same adds
 * in the same order, in whichever vectors the compiler picks (no reassociation is allowed). */
static inline void group_lanes_unpacked(const float *restrict g, const float *restrict c,
                                        int64_t gs, float *restrict a, float *restrict b) {
    for (int l = 0; l < LANES; l++) a[l] = b[l] = 0.0f;
    for (int64_t k = 0; k < gs; k += LANES)
        for (int l = 0; l < LANES; l++) {
            a[l] += g[k + l] * c[k + l];
            b[l] += g[k + l];
        }
}

typedef struct {
    const uint32_t *qweight;
    const float *grad;
    float *grad_s, *grad_o;
    int64_t groups, gs;
    int bits;
} packed_job;

/* Each group unpacked where it is summed (unpack.h's SIMD paths): the codes are never written
 * out a byte each. */
static int backward_packed_part(const void *ctx, int64_t lo, int64_t hi) {
    const packed_job *j = ctx;
    const group_unpacker unpack = make_group_unpacker(j->bits, 0);
    const int64_t words = j->bits * j->gs / 32;
    float c[MAX_GROUP];
    for (int64_t k = lo * j->groups; k < hi * j->groups; k++) {
        float a[LANES], b[LANES];
        unpack_codes_as_floats(&unpack, (const uint8_t *)(j->qweight + k * words), j->gs, c);
        group_lanes_unpacked(j->grad + k * j->gs, c, j->gs, a, b);
        j->grad_s[k] = fold_lanes(a);
        j->grad_o[k] = fold_lanes(b);
    }
    return 0;
}

int dq_tunable_backward_packed(const float *grad, const uint32_t *qweight, int64_t rows,
                               int64_t groups, int64_t gs, int bits, float *grad_s,
                               float *grad_o, int threads) {
    if (gs % LANES || gs % 32 || gs > MAX_GROUP || bits < 1 || bits > 8) return -1;
    const packed_job j = {.qweight = qweight, .grad = grad, .grad_s = grad_s, .grad_o = grad_o,
                          .groups = groups, .gs = gs, .bits = bits};
    return dq_parallel(backward_packed_part, &j, rows, threads);
}

int dq_tunable_forward(const uint8_t *q, const float *s, const float *o, int64_t rows,
                       int64_t groups, int64_t gs, float *w, int threads) {
    if (gs % LANES) return -1;
    const tunable_job j = {.q = q, .s = s, .o = o, .w = w, .groups = groups, .gs = gs};
    return dq_parallel(forward_part, &j, rows, threads);
}

int dq_tunable_forward_bf16(const uint8_t *q, const float *s, const float *o, int64_t rows,
                            int64_t groups, int64_t gs, uint16_t *w, int threads) {
    if (gs % LANES) return -1;
    const tunable_job j = {.q = q, .s = s, .o = o, .w16 = w, .groups = groups, .gs = gs};
    return dq_parallel(forward_part, &j, rows, threads);
}

int dq_tunable_backward(const void *grad, int grad_bf16, const uint8_t *q, int64_t rows,
                        int64_t groups, int64_t gs, float *grad_s, float *grad_o, int threads) {
    if (gs % LANES) return -1;
    const tunable_job j = {.q = q, .grad = grad_bf16 ? NULL : grad,
                           .grad16 = grad_bf16 ? grad : NULL, .grad_s = grad_s,
                           .grad_o = grad_o, .groups = groups, .gs = gs};
    return dq_parallel(backward_part, &j, rows, threads);
}
