/* A few float32 tokens times a dense bf16 matrix (a Linear the checkpoint stores dense, kept in
 * its file dtype while the model computes in float32): bf16 -> float32 is a 16-bit shift, done
 * here on the fly, so the matrix is held at 2 bytes a weight and read once per token.
 *
 * y[t, r] = sum_j w[r, j] * x[t, j] in float32, the products of j summed in 16 lanes (lane l:
 * j % 16 == l, in order of j), the lanes combined as lane_sum (unpack.h), then the tail j >= the
 * last multiple of 16 added in order. */
#include "pool.h"
#include "unpack.h"

static inline float dense_row_bf16(const uint16_t *w, const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += bf16_value(w[j + l]) * x[j + l];
    float s = lane_sum(acc);
    for (; j < n; j++) s += bf16_value(w[j]) * x[j];
    return s;
}

typedef struct {
    const uint16_t *w;
    int64_t cols, m;
    const float *x;
    float *y;
    int64_t y_stride;
} dense_job;

static int dense_rows(const void *ctx, int64_t lo, int64_t hi) {
    const dense_job *j = ctx;
    for (int64_t r = lo; r < hi; r++) {
        __builtin_prefetch(j->w + (r + 4) * j->cols, 0, 0);
        for (int64_t t = 0; t < j->m; t++)
            j->y[t * j->y_stride + r] = dense_row_bf16(j->w + r * j->cols, j->x + t * j->cols,
                                                       j->cols);
    }
    return 0;
}

/* y [m, rows] (row stride y_stride) = x [m, cols] @ w^T for bf16 w [rows, cols], rows split
 * over `threads` threads (pool.c). */
int dq_dense_matvec_bf16_mt(const uint16_t *w, int64_t rows, int64_t cols, const float *x,
                            int64_t m, float *y, int64_t y_stride, int threads) {
    const dense_job j = {.w = w, .cols = cols, .m = m, .x = x, .y = y, .y_stride = y_stride};
    return dq_parallel(dense_rows, &j, rows, threads);
}
