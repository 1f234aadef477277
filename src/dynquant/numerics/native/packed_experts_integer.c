/* Expert pairs with int8 or int16 activations (MoE decode): pair p multiplies token x[p] with
 * expert experts[p] of a bank, rows [lo, hi) of each expert: job.m pairs, job.y [pairs, rows_per_expert], job.y_stride rows_per_expert; each pair's row
 * equals the one-token product of that expert alone (packed_matvec_q8.c, packed_matvec_q16.c). */
#include "integer_dots.h"

typedef struct {
    const void *job; /* a q8_job, or a q16_job where `wide` */
    int wide;
    const int64_t *experts;
    int64_t rows_per_expert;
} pairs_job;

/* Job `one` (a copy of j, int8 or int16: their fields are named alike) narrowed to pair p:
 * expert experts[p]'s rows, the pair's token (d_per: its scales a token) and output row. */
#define NARROW_TO_PAIR(one, j, pj, p, d_per)                                                   \
    do {                                                                                       \
        const int64_t groups_ = (j)->padded_n / (j)->gs, words_ = (j)->bits * (j)->gs / 32;   \
        const int64_t first_ = (pj)->experts[p] * (pj)->rows_per_expert;                      \
        (one).qweight = (j)->qweight + first_ * groups_ * words_;                              \
        (one).scales = (j)->scales + first_ * groups_;                                         \
        (one).offsets = (j)->offsets + first_ * groups_;                                       \
        (one).x.xq = (j)->x.xq + (p) * (j)->padded_n;                                          \
        (one).x.d = (j)->x.d + (p) * (d_per);                                                  \
        (one).x.xsum = (j)->x.xsum + (p) * groups_;                                            \
        (one).m = 1;                                                                           \
        (one).y = (j)->y + (p) * (j)->y_stride;                                                \
    } while (0)

static int pairs_rows(const void *ctx, int64_t lo, int64_t hi) {
    const pairs_job *pj = ctx;
    if (pj->wide) {
        const q16_job *j = pj->job;
        for (int64_t p = 0; p < j->m; p++) {
            q16_job one = *j;
            NARROW_TO_PAIR(one, j, pj, p, j->padded_n / j->gs);
            q16_rows(&one, lo, hi);
        }
        return 0;
    }
    const q8_job *j = pj->job;
    for (int64_t p = 0; p < j->m; p++) {
        q8_job one = *j;
        NARROW_TO_PAIR(one, j, pj, p, j->padded_n / Q8_BLOCK);
        q8_rows(&one, lo, hi);
    }
    return 0;
}

/* F.linear(x[p], W[experts[p]]) for every pair: x [pairs, padded_n] (zero padding), y [pairs,
 * rows_per_expert], the tokens quantized to int8 (wide: int16, widths 2-6); -1 if out of memory
 * or the layout is unsupported. */
int dq_matvec_integer_experts_mt(int wide, const uint32_t *qweight, const uint16_t *scales,
                                 const uint16_t *offsets, int64_t rows_per_expert,
                                 int64_t padded_n, int64_t gs, int bits, const int64_t *experts,
                                 int64_t pairs, const float *x, float *y, int threads) {
    if (!(wide ? q16_supported(gs, bits) : q8_supported(gs, bits))) return -1;
    const q16_tokens t16 = wide ? q16_quantize_tokens(x, pairs, padded_n, gs, bits, 0)
                                : (q16_tokens){0};
    const q8_tokens t8 = wide ? (q8_tokens){0} : q8_quantize_tokens(x, pairs, padded_n, gs, bits);
    const float *owned = wide ? t16.d : t8.d;
    if (!owned) return -1;
    const q8_job j8 = {.qweight = qweight, .scales = scales, .offsets = offsets,
                       .padded_n = padded_n, .gs = gs, .bits = bits, .x = t8, .m = pairs, .y = y,
                       .y_stride = rows_per_expert};
    const q16_job j16 = {.qweight = qweight, .scales = scales, .offsets = offsets,
                         .padded_n = padded_n, .gs = gs, .bits = bits, .x = t16, .m = pairs,
                         .y = y, .y_stride = rows_per_expert};
    const pairs_job pj = {.job = wide ? (const void *)&j16 : (const void *)&j8, .wide = wide,
                          .experts = experts, .rows_per_expert = rows_per_expert};
    const int rc = dq_parallel(pairs_rows, &pj, rows_per_expert, threads);
    free((void *)owned);
    return rc;
}
