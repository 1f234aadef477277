/* pool.c: run fn(ctx, lo, hi) over parts of [0, n) on `threads` threads (the caller included). */
#ifndef DQ_POOL_H
#define DQ_POOL_H
#include <stdint.h>
typedef int (*dq_range_fn)(const void *ctx, int64_t lo, int64_t hi);
int dq_parallel(dq_range_fn fn, const void *ctx, int64_t n, int threads);
#endif
