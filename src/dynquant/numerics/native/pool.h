/* pool.c: run fn(ctx, lo, hi) over parts of [0, n) on `threads` threads (the caller included). */
#ifndef DQ_POOL_H
#define DQ_POOL_H
#include <stdint.h>
typedef int (*dq_range_fn)(const void *ctx, int64_t lo, int64_t hi);
int dq_parallel(dq_range_fn fn, const void *ctx, int64_t n, int threads);

/* The arguments of a product kernel, handed to the functions that run one part of it. */
typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t rows, padded_n, gs; /* rows: of the block, or of one expert for the pairs kernels */
    int bits, portable;
    const float *x;
    int64_t m;
    float *y;
    int64_t y_stride;
    const int64_t *experts; /* the pairs kernels: pair p multiplies expert experts[p] */
} dq_job;
#endif
