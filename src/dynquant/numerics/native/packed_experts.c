/* Routed experts of a bank for a few (token, expert) pairs in one call (MoE decode): pair p
 * multiplies its own row of x with expert experts[p] of the bank, read straight from the packed
 * codes by the one-token kernels (packed_matvec.c, packed_vecmat.c). No Python loop over routed
 * experts, no gather of expert matrices; each pair's result is bit-identical to the one-token
 * kernel's for that expert alone.
 *
 * A bank is [E * rows_per_expert, padded_n] packed rows, expert e's rows contiguous. */
#include "pool.h"
#include "unpack.h"

/* F.linear(x[p], W[e_p]) for rows [r0, r1) of each expert: x [pairs, padded_n] (zero padding),
 * y [pairs, rows_per_expert]. */
int dq_matvec_experts(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                      int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                      const int64_t *experts, int64_t pairs, const float *x, float *y,
                      int64_t r0, int64_t r1, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t row = experts[p] * rows_per_expert + r0;
        const int rc = dq_matvec(qweight + row * groups * words, scales + row * groups,
                                 offsets + row * groups, r1 - r0, padded_n, gs, bits,
                                 x + p * padded_n, 1, y + p * rows_per_expert + r0,
                                 rows_per_expert, portable);
        if (rc) return rc;
    }
    return 0;
}

/* x[p] @ W[e_p] for groups [g0, g1) of the output: x [pairs, rows_per_expert],
 * y [pairs, padded_n]. */
int dq_vecmat_experts(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                      int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                      const int64_t *experts, int64_t pairs, const float *x, float *y,
                      int64_t g0, int64_t g1, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t row = experts[p] * rows_per_expert;
        const int rc = dq_vecmat(qweight + row * groups * words, scales + row * groups,
                                 offsets + row * groups, rows_per_expert, padded_n, gs, bits,
                                 x + p * rows_per_expert, 1, g0, g1, y + p * padded_n, portable);
        if (rc) return rc;
    }
    return 0;
}

/* Both with their rows (matvec) or pairs (vecmat) split over `threads` threads (pool.c); j->m
 * is the number of pairs, j->rows an expert's rows. */
static int matvec_experts_rows(const void *ctx, int64_t lo, int64_t hi) {
    const dq_job *j = ctx;
    return dq_matvec_experts(j->qweight, j->scales, j->offsets, j->rows, j->padded_n, j->gs,
                             j->bits, j->experts, j->m, j->x, j->y, lo, hi, j->portable);
}

/* Pairs [lo, hi), every group: each thread streams whole experts front to back (a split by
 * groups had both threads read every row's cache lines: ~2x the memory traffic). */
static int vecmat_experts_pairs(const void *ctx, int64_t lo, int64_t hi) {
    const dq_job *j = ctx;
    return dq_vecmat_experts(j->qweight, j->scales, j->offsets, j->rows, j->padded_n, j->gs,
                             j->bits, j->experts + lo, hi - lo, j->x + lo * j->rows,
                             j->y + lo * j->padded_n, 0, j->padded_n / j->gs, j->portable);
}

static dq_job experts_job(const uint32_t *qweight, const uint16_t *scales,
                          const uint16_t *offsets, int64_t rows_per_expert, int64_t padded_n,
                          int64_t gs, int bits, const int64_t *experts, int64_t pairs,
                          const float *x, float *y, int portable) {
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets,
                      .rows = rows_per_expert, .padded_n = padded_n, .gs = gs, .bits = bits,
                      .portable = portable, .x = x, .m = pairs, .y = y, .experts = experts};
    return j;
}

int dq_matvec_experts_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                         int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                         const int64_t *experts, int64_t pairs, const float *x, float *y,
                         int portable, int threads) {
    const dq_job j = experts_job(qweight, scales, offsets, rows_per_expert, padded_n, gs, bits,
                                 experts, pairs, x, y, portable);
    return dq_parallel(matvec_experts_rows, &j, rows_per_expert, threads);
}

int dq_vecmat_experts_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                         int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                         const int64_t *experts, int64_t pairs, const float *x, float *y,
                         int portable, int threads) {
    const dq_job j = experts_job(qweight, scales, offsets, rows_per_expert, padded_n, gs, bits,
                                 experts, pairs, x, y, portable);
    return dq_parallel(vecmat_experts_pairs, &j, pairs, threads);
}

/* A bank's pairs with the bank's fixed arguments prepared once by the caller (decode calls this
 * once per bank per step): the kernel its kind names, on its threads from min_work multiply-adds.
 * For the F.linear kinds x holds in_features values a pair, copied beside zeros here where the
 * layout pads them. Same products as the *_mt calls. */
int dq_experts_one(const dq_expert_pairs *b, const int64_t *experts, int64_t pairs,
                   const float *x, float *y) {
    for (int64_t p = 0; p < pairs; p++)
        if (experts[p] < 0 || experts[p] >= b->experts) return -2;
    const int threads = pairs * b->rows_per_expert * b->padded_n >= b->min_work ? b->threads : 1;
    if (b->kind == DQ_PAIRS_VECMAT)
        return dq_vecmat_experts_mt(b->qweight, b->scales, b->offsets, b->rows_per_expert,
                                    b->padded_n, b->gs, b->bits, experts, pairs, x, y, 0, threads);
    float *padded = NULL;
    if (b->in_features < b->padded_n) {
        if (!(padded = padded_rows(x, pairs, b->in_features, b->padded_n))) return -1;
        x = padded;
    }
    const int rc = b->kind == DQ_PAIRS_MATVEC
        ? dq_matvec_experts_mt(b->qweight, b->scales, b->offsets, b->rows_per_expert, b->padded_n,
                               b->gs, b->bits, experts, pairs, x, y, 0, threads)
        : dq_matvec_integer_experts_mt(b->kind == DQ_PAIRS_MATVEC_Q16, b->qweight, b->scales,
                                       b->offsets, b->rows_per_expert, b->padded_n, b->gs,
                                       b->bits, experts, pairs, x, y, threads);
    free(padded);
    return rc;
}
