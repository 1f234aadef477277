/* dynquant's native step of the tuned rounding (numerics/tuned_scales.py, RoundingOffsets.step):
 * for each weight that can change its code, Adam's step on its offset u (moments kept in bf16),
 * clipped to the step size, then its code clamp(round(q0 + u)) written where it changed. The
 * same float32 operations in the same order as the torch path (IEEE, no fused multiply-adds;
 * the square root correctly rounded, as the torch path takes it in float64), in one pass over
 * the weights instead of one per operation: a block of them at a time through the vector units,
 * then the few codes that changed written one by one; the blocks split over the threads (the
 * pass is bound by the ~14 bytes a weight it reads from memory, which one core does not drain).
 */
#include <math.h>
#include <stdatomic.h>

#include "kernels.h"
#include "pool.h"
#include "unpack.h" /* bf16_value, bf16_round, clamp */

#define BLOCK 256

static int64_t rounding_step(const float *restrict grad, const int32_t *restrict index,
                             int64_t n, float *restrict u, uint16_t *restrict m,
                             uint16_t *restrict s2, const uint8_t *restrict q0,
                             uint8_t *restrict now, uint8_t *restrict codes,
                             const float *restrict k, int max_code) {
    const float b1 = k[0], a1 = k[1], b2 = k[2], a2 = k[3], root = k[4], eps = k[5];
    const float unbias = k[6], lr = k[7], top = (float)max_code;
    int64_t moved = 0;
    uint8_t code[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t e = n - b < BLOCK ? n - b : BLOCK;
        for (int64_t j = 0; j < e; j++) {
            const int64_t i = b + j;
            const float g = grad[index[i]];
            const float mi = bf16_value(m[i]) * b1 + a1 * g;
            const float si = bf16_value(s2[i]) * b2 + a2 * (g * g);
            m[i] = bf16_round(mi);
            s2[i] = bf16_round(si);
            const float step = clamp(mi / (sqrtf(si) / root + eps) * unbias, -1.0f, 1.0f);
            const float ui = clamp(u[i] - lr * step, -1.0f, 1.0f);
            u[i] = ui;
            code[j] = (uint8_t)clamp(rintf((float)q0[i] + ui), 0.0f, top);
        }
        for (int64_t j = 0; j < e; j++) {
            if (code[j] != now[b + j]) {
                now[b + j] = code[j];
                codes[index[b + j]] = code[j];
                moved++;
            }
        }
    }
    return moved;
}

typedef struct {
    const float *grad;
    const int32_t *index;
    float *u;
    uint16_t *m, *s2;
    const uint8_t *q0;
    uint8_t *now, *codes;
    const float *k;
    int64_t n;
    int max_code;
    _Atomic int64_t moved;
} rounding_job;

/* Blocks [first, last) of the weights: each weight's step is its own, so the threads' parts
 * write disjoint u, m, s2, now and codes, and any cut gives the same. */
static int rounding_part(const void *ctx, int64_t first, int64_t last) {
    rounding_job *j = (rounding_job *)ctx; /* (its counter is the one shared field written) */
    const int64_t lo = first * BLOCK, hi = last * BLOCK < j->n ? last * BLOCK : j->n;
    const int64_t moved = rounding_step(j->grad, j->index + lo, hi - lo, j->u + lo, j->m + lo,
                                        j->s2 + lo, j->q0 + lo, j->now + lo, j->codes, j->k,
                                        j->max_code);
    atomic_fetch_add_explicit(&j->moved, moved, memory_order_relaxed);
    return 0;
}

int64_t dq_rounding_step(const float *grad, const int32_t *index, int64_t n, float *u,
                         uint16_t *m, uint16_t *s2, const uint8_t *q0, uint8_t *now,
                         uint8_t *codes, const float *k, int max_code, int threads) {
    rounding_job j = {.grad = grad, .index = index, .u = u, .m = m, .s2 = s2, .q0 = q0,
                      .now = now, .codes = codes, .k = k, .n = n, .max_code = max_code};
    atomic_init(&j.moved, 0);
    dq_parallel(rounding_part, &j, (n + BLOCK - 1) / BLOCK, threads);
    return atomic_load(&j.moved);
}
