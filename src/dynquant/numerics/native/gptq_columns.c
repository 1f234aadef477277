/* GPTQ's sweep over a run of columns (numerics/gptq.py, _ColumnSweep): w is the act-ordered
 * transpose [columns][rows] (a column's weights contiguous); for each column k in [k0, k1), its
 * weights rounded with their group's scale and offset (codes clamp(rint((w - o) / d)), d the
 * scale, or infinity where it is 0), the rounding error divided by u[k][k] kept in
 * errors[k - start], and taken off the sub-block's later columns k + 1 .. sub_end - 1
 * (w[j] -= u[k][j] * err); where residual is given, each weight's rounding residual too
 * (float16 bits [columns][rows]). The same float32 operations in the same order as the numpy
 * and torch code it stands for (IEEE, no fused multiply-adds). Every row's sweep is its own, so
 * the rows split over the threads, a chunk at a time small enough for the sub-block's columns of
 * it to stay in the first-level cache; numpy instead walks the whole column (a 49,152-row
 * head's: 192 KiB) once per operation, on one thread.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "pool.h"
#include "unpack.h" /* clamp */

#define CHUNK 256 /* rows: 16 columns of them are 16 KiB */

typedef struct {
    float *w;
    const float *u;
    const float *scales, *offsets, *divisors;
    uint8_t *codes;
    uint16_t *residual;
    const int64_t *column;
    float *errors;
    int64_t rows, columns, k0, k1, sub_end, start, group_size;
    int max_code;
} columns_job;

/* What each weight's rounding left, in codes, as numerics/gptq.py's _residual_chunk makes it:
 * (w - o) / s - code (0 where the scale is 0) clamped to [-1, 1], rounded to float16, and one
 * float16 step towards 0 where that rounding would take the code elsewhere. */
static void rounding_residual(const float *restrict w, const float *restrict s,
                              const float *restrict o, const float *restrict d,
                              const uint8_t *restrict q, uint16_t *restrict out, int64_t n,
                              float top) {
    for (int64_t r = 0; r < n; r++) {
        const float c = (float)q[r];
        const float v = s[r] == 0.0f ? 0.0f : clamp((w[r] - o[r]) / d[r] - c, -1.0f, 1.0f);
        const _Float16 h = (_Float16)v;
        uint16_t bits;
        memcpy(&bits, &h, sizeof bits);
        if (clamp(rintf(c + (float)h), 0.0f, top) != c && (bits & 0x7fff))
            bits -= 1; /* a float16's magnitude one step down */
        out[r] = bits;
    }
}

/* Rows [lo, hi) of columns k0 .. k1 - 1. */
static void round_rows(const columns_job *j, int64_t lo, int64_t hi) {
    const int64_t n = hi - lo, rows = j->rows;
    const float top = (float)j->max_code;
    for (int64_t k = j->k0; k < j->k1; k++) {
        const int64_t g = j->column[k] / j->group_size;
        const float *restrict s = j->scales + g * rows + lo;
        const float *restrict o = j->offsets + g * rows + lo;
        const float *restrict d = j->divisors + g * rows + lo;
        const float *restrict wk = j->w + k * rows + lo;
        uint8_t *restrict q = j->codes + j->column[k] * rows + lo;
        float *restrict e = j->errors + (k - j->start) * rows + lo;
        const float ukk = j->u[k * j->columns + k];
        for (int64_t r = 0; r < n; r++) {
            const float c = clamp(rintf((wk[r] - o[r]) / d[r]), 0.0f, top);
            q[r] = (uint8_t)c;
            e[r] = (wk[r] - (c * s[r] + o[r])) / ukk;
        }
        if (j->residual)
            rounding_residual(wk, s, o, d, q, j->residual + k * rows + lo, n, top);
        for (int64_t c = k + 1; c < j->sub_end; c++) {
            const float ukc = j->u[k * j->columns + c];
            float *restrict wc = j->w + c * rows + lo;
            for (int64_t r = 0; r < n; r++)
                wc[r] -= ukc * e[r];
        }
    }
}

static int columns_part(const void *ctx, int64_t first, int64_t last) {
    const columns_job *j = (const columns_job *)ctx;
    for (int64_t b = first; b < last; b++) {
        const int64_t lo = b * CHUNK, hi = lo + CHUNK < j->rows ? lo + CHUNK : j->rows;
        round_rows(j, lo, hi);
    }
    return 0;
}

int dq_gptq_columns(float *w, const float *u, int64_t rows, int64_t columns, int64_t k0,
                    int64_t k1, int64_t sub_end, int64_t start, const int64_t *column,
                    int64_t group_size, const float *scales, const float *offsets,
                    const float *divisors, uint8_t *codes, uint16_t *residual,
                    float *errors, int max_code, int threads) {
    if (k0 < start || k1 > sub_end || sub_end > columns || group_size <= 0)
        return -1;
    columns_job j = {.w = w, .u = u, .scales = scales, .offsets = offsets,
                     .divisors = divisors, .codes = codes, .residual = residual,
                     .column = column, .errors = errors,
                     .rows = rows, .columns = columns, .k0 = k0, .k1 = k1, .sub_end = sub_end,
                     .start = start, .group_size = group_size, .max_code = max_code};
    dq_parallel(columns_part, &j, (rows + CHUNK - 1) / CHUNK, threads);
    return 0;
}
