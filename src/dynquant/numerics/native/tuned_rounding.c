/* dynquant's native step of the tuned rounding (numerics/tuned_scales.py, RoundingOffsets.step):
 * for each weight that can change its code, Adam's step on its offset u (moments kept in bf16),
 * clipped to the step size, then its code clamp(round(q0 + u)) written where it changed. The
 * same float32 operations in the same order as the torch path (IEEE, no fused multiply-adds;
 * the square root correctly rounded, as the torch path takes it in float64), in one pass over
 * the weights instead of one per operation.
 *
 * Which weights can change is a bit a weight (`mask`, 64 to a word, low bit first), their state
 * in their order: a segment of SEGMENT weights at a time their places are listed from the mask
 * (a mask byte at a time: its set bits' places from a 256-entry table, eight written, its count
 * kept), then stepped through the vector units, then the few codes that changed written one by
 * one. Segments split over the threads (the pass is bound by the ~9 bytes a weight it reads
 * from memory, which one core does not drain); `first[s]` is the count of tunable weights
 * before segment s, so any cut gives the same. A bf16 gradient (a bf16 pass's) is widened a
 * segment at a time into a float buffer the step gathers from (the same values: widening is
 * exact), where gathering its 16-bit values one by one would keep the step from the vector units.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>

#include "kernels.h"
#include "pool.h"
#include "unpack.h" /* bf16_value, bf16_round, clamp */

#define SEGMENT_WORDS (DQ_ROUNDING_SEGMENT / 64)

/* For each byte of the mask, the places of its set bits, low bit first (then zeros). */
static uint8_t byte_places[256][8];
static pthread_once_t byte_places_made = PTHREAD_ONCE_INIT;

static void make_byte_places(void) {
    for (int v = 0; v < 256; v++) {
        int n = 0;
        for (int b = 0; b < 8; b++) {
            if (v >> b & 1) {
                byte_places[v][n++] = (uint8_t)b;
            }
        }
    }
}

/* The n tunable weights at places place[0..n) (of grad and codes, from the segment's start),
 * their state from u, m, s2, q0 on. */
static int64_t rounding_step(const float *restrict grad, const int32_t *restrict place,
                             int64_t n, float *restrict u, uint16_t *restrict m,
                             uint16_t *restrict s2, const uint8_t *restrict q0,
                             uint8_t *restrict codes, const float *restrict k, int max_code) {
    const float b1 = k[0], a1 = k[1], b2 = k[2], a2 = k[3], root = k[4], eps = k[5];
    const float unbias = k[6], lr = k[7], top = (float)max_code;
    uint8_t code[DQ_ROUNDING_SEGMENT];
    for (int64_t i = 0; i < n; i++) {
        const float g = grad[place[i]];
        const float mi = bf16_value(m[i]) * b1 + a1 * g;
        const float si = bf16_value(s2[i]) * b2 + a2 * (g * g);
        m[i] = bf16_round(mi);
        s2[i] = bf16_round(si);
        const float step = clamp(mi / (sqrtf(si) / root + eps) * unbias, -1.0f, 1.0f);
        const float ui = clamp(u[i] - lr * step, -1.0f, 1.0f);
        u[i] = ui;
        code[i] = (uint8_t)clamp(rintf((float)q0[i] + ui), 0.0f, top);
    }
    int64_t moved = 0;
    for (int64_t i = 0; i < n; i++) {
        if (code[i] != codes[place[i]]) {
            codes[place[i]] = code[i];
            moved++;
        }
    }
    return moved;
}

typedef struct {
    const float *grad;
    const uint16_t *grad16;
    const uint64_t *mask;
    const int64_t *first;
    int64_t words;
    float *u;
    uint16_t *m, *s2;
    const uint8_t *q0;
    uint8_t *codes;
    const float *k;
    int max_code;
    _Atomic int64_t moved;
} rounding_job;

/* Segments [first, last): each weight's step is its own, so the threads' parts write disjoint
 * u, m, s2 and codes. */
static int rounding_part(const void *ctx, int64_t first, int64_t last) {
    rounding_job *j = (rounding_job *)ctx; /* (its counter is the one shared field written) */
    int32_t place[DQ_ROUNDING_SEGMENT + 8];
    float widened[DQ_ROUNDING_SEGMENT];
    int64_t moved = 0;
    for (int64_t s = first; s < last; s++) {
        const int64_t w0 = s * SEGMENT_WORDS;
        const int64_t w1 = w0 + SEGMENT_WORDS < j->words ? w0 + SEGMENT_WORDS : j->words;
        int64_t n = 0;
        const uint8_t *bytes = (const uint8_t *)(j->mask + w0);
        for (int64_t b = 0; b < (w1 - w0) * 8; b++) { /* 8 places written, count(byte) kept */
            const int32_t base = (int32_t)(b * 8); /* from the segment's first weight */
            const uint8_t *at = byte_places[bytes[b]];
            for (int e = 0; e < 8; e++) {
                place[n + e] = base + at[e];
            }
            n += __builtin_popcount(bytes[b]);
        }
        const int64_t at = j->first[s];
        const float *grad = j->grad ? j->grad + w0 * 64 : widened;
        if (j->grad16 && n > 0) /* up to the last place: the mask's padding has no gradient */
            for (int32_t i = 0; i <= place[n - 1]; i++)
                widened[i] = bf16_value(j->grad16[w0 * 64 + i]);
        moved += rounding_step(grad, place, n, j->u + at, j->m + at, j->s2 + at, j->q0 + at,
                               j->codes + w0 * 64, j->k, j->max_code);
    }
    atomic_fetch_add_explicit(&j->moved, moved, memory_order_relaxed);
    return 0;
}

int64_t dq_rounding_step(const void *grad, int grad_bf16, const uint64_t *mask,
                         const int64_t *first, int64_t words, float *u, uint16_t *m,
                         uint16_t *s2, const uint8_t *q0, uint8_t *codes, const float *k,
                         int max_code, int threads) {
    pthread_once(&byte_places_made, make_byte_places);
    rounding_job j = {.grad = grad_bf16 ? NULL : grad, .grad16 = grad_bf16 ? grad : NULL,
                      .mask = mask, .first = first, .words = words, .u = u,
                      .m = m, .s2 = s2, .q0 = q0, .codes = codes, .k = k, .max_code = max_code};
    atomic_init(&j.moved, 0);
    dq_parallel(rounding_part, &j, (words + SEGMENT_WORDS - 1) / SEGMENT_WORDS, threads);
    return atomic_load(&j.moved);
}
