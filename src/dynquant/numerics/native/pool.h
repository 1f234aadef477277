/* pool.c: run fn(ctx, lo, hi) over parts of [0, n) on `threads` threads (the caller included). */
#ifndef DQ_POOL_H
#define DQ_POOL_H
#include <stdint.h>
typedef int (*dq_range_fn)(const void *ctx, int64_t lo, int64_t hi);
int dq_parallel(dq_range_fn fn, const void *ctx, int64_t n, int threads);
/* 1: jobs follow each other closely until dq_pool_hold(0) (the workers' waits spin longer). */
void dq_pool_hold(int on);

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

/* The two shapes of product kernel: over a block of rows (dq_matvec, dq_gemm: y [m, rows] with
 * row stride y_stride), and over groups [g0, g1) of the output (dq_vecmat, dq_gemm_t). */
typedef int (*dq_rows_kernel)(const uint32_t *qweight, const uint16_t *scales,
                              const uint16_t *offsets, int64_t rows, int64_t padded_n, int64_t gs,
                              int bits, const float *x, int64_t m, float *y, int64_t y_stride,
                              int portable);
typedef int (*dq_groups_kernel)(const uint32_t *qweight, const uint16_t *scales,
                                const uint16_t *offsets, int64_t rows, int64_t padded_n,
                                int64_t gs, int bits, const float *x, int64_t m, int64_t g0,
                                int64_t g1, float *y, int portable);
/* kernel over job j, its rows (or its output's groups) split over `threads` threads. */
int dq_parallel_rows(dq_rows_kernel kernel, const dq_job *j, int threads);
int dq_parallel_groups(dq_groups_kernel kernel, const dq_job *j, int threads);
#endif
