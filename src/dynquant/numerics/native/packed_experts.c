/* Routed experts of a bank for a few (token, expert) pairs in one call (MoE decode): pair p
 * multiplies its own row of x with expert experts[p] of the bank, read straight from the packed
 * codes by the one-token kernels (packed_matvec.c, packed_vecmat.c). No Python loop over routed
 * experts, no gather of expert matrices; each pair's result is bit-identical to the one-token
 * kernel's for that expert alone.
 *
 * A bank is [E * rows_per_expert, padded_n] packed rows, expert e's rows contiguous. */
#include "pool.h"
#include "unpack.h"

int dq_matvec(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              float *y, int64_t y_stride, int portable);
int dq_matvec_integer_experts_mt(int wide, const uint32_t *qweight, const uint16_t *scales,
                                 const uint16_t *offsets, int64_t rows_per_expert,
                                 int64_t padded_n, int64_t gs, int bits, const int64_t *experts,
                                 int64_t pairs, const float *x, float *y, int threads);
int dq_vecmat(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable);

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
 * once per bank per step). a: qweight, scales, offsets (addresses), rows_per_expert, padded_n,
 * gs, bits, experts in the bank, kind (0: F.linear(x, W[e]), dq_matvec_experts; 1: x @ W[e],
 * dq_vecmat_experts, y [pairs, padded_n]; 2: F.linear(x, W[e]) with int8 activations,
 * dq_matvec_integer_experts_mt; 3: with int16 activations, the same), work from which
 * to split, threads then, in_features. For kinds 0, 2 and 3, x holds in_features values a pair, copied beside zeros here where the layout pads
 * them. An expert index outside the bank: -2, nothing computed. Same products as the *_mt
 * calls. */
int dq_experts_one(const int64_t *a, const int64_t *experts, int64_t pairs, const float *x,
                   float *y) {
    for (int64_t p = 0; p < pairs; p++)
        if (experts[p] < 0 || experts[p] >= a[7]) return -2;
    const int threads = pairs * a[3] * a[4] >= a[9] ? (int)a[10] : 1;
    const uint32_t *q = (const uint32_t *)(intptr_t)a[0];
    const uint16_t *s = (const uint16_t *)(intptr_t)a[1], *o = (const uint16_t *)(intptr_t)a[2];
    if (a[8] == 1)
        return dq_vecmat_experts_mt(q, s, o, a[3], a[4], a[5], (int)a[6], experts, pairs, x, y, 0,
                                    threads);
    float *padded = NULL;
    if (a[11] < a[4]) {
        if (!(padded = padded_rows(x, pairs, a[11], a[4]))) return -1;
        x = padded;
    }
    const int rc = a[8] >= 2 ? dq_matvec_integer_experts_mt(a[8] == 3, q, s, o, a[3], a[4], a[5],
                                                            (int)a[6], experts, pairs, x, y,
                                                            threads)
                             : dq_matvec_experts_mt(q, s, o, a[3], a[4], a[5], (int)a[6], experts,
                                                    pairs, x, y, 0, threads);
    free(padded);
    return rc;
}
