/* Dequantization of a 4-bit module held in torch's CPU int4 layout (runtime/int4_cpu.py). Decode
 * runs on torch's int4 kernel, which holds the module's only copy of the codes; a long bf16
 * prefill dequantizes row blocks from that copy for the bf16 GEMM instead (at 512 tokens the int4
 * kernel runs at ~0.37x the bf16 GEMM of the same matrix).
 *
 * torch's layout (_convert_weight_to_int4pack_for_cpu; int4_cpu.py finds its block size on a
 * probe at run time and holds the plain reference): rows in blocks of B (64 where torch runs its
 * AVX-512 kernels, 32 with AVX2), a block is [k][B / 2] bytes, byte d holding row d in its low
 * nibble and row d + B / 2 in its high one; a last block of nb < B rows is [k][nb / 2] bytes,
 * byte j holding rows 2j (low) and 2j + 1 (high).
 * w = q * scale + offset in float32, a multiply then an add, as dequantize_rows.c computes it:
 * scale comes from the kernel's [groups, n, 2] scale/zero pairs (element 0, our bf16 scale),
 * offset from the module's own [n, groups] offsets (the kernel's zero point is rounded). */
#include "pool.h"
#include "unpack.h"

#define INT4_MAX_BLOCK 64

/* One row's group: w[j] = q[j] * s + o from gs codes, one a byte (already shifted down). */
static inline void group_values(const uint8_t *q, int64_t gs, float s, float o, void *out,
                                int out_bf16) {
    if (out_bf16) {
        uint16_t *dst = out;
        for (int64_t j = 0; j < gs; j++) dst[j] = bf16_round((float)(q[j] & 15) * s + o);
    } else {
        float *dst = out;
        for (int64_t j = 0; j < gs; j++) dst[j] = (float)(q[j] & 15) * s + o;
    }
}

/* Rows [lo, hi) of one block (rows_here of B rows from block_row), codes read at their stride. */
static void rows_by_stride(const uint8_t *packed, const uint16_t *scale_zero,
                           const uint16_t *offsets, int64_t n, int64_t k, int64_t gs, int64_t B,
                           int64_t block_row, int64_t rows_here, int64_t lo, int64_t hi,
                           char *out, int64_t row_bytes, int out_bf16) {
    const int64_t groups = k / gs, esize = out_bf16 ? 2 : 4;
    uint8_t q[MAX_GROUP];
    for (int64_t r = lo; r < hi; r++) {
        const int64_t in_block = r - block_row;
        const int full = rows_here == B;
        const int64_t stride = rows_here / 2;
        const int64_t byte = full ? in_block % (B / 2) : in_block / 2;
        const int shift = full ? (in_block < B / 2 ? 0 : 4) : (int)(in_block % 2) * 4;
        const uint8_t *src = packed + block_row * k / 2 + byte;
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t j = 0; j < gs; j++) q[j] = (uint8_t)(src[(g * gs + j) * stride] >> shift);
            group_values(q, gs, bf16_value(scale_zero[2 * (g * n + r)]),
                         bf16_value(offsets[r * groups + g]),
                         out + r * row_bytes + g * gs * esize, out_bf16);
        }
    }
}

/* A whole block of B rows: each group's [gs][B / 2] bytes transposed to [B / 2][gs] in a small
 * buffer, then rows d and d + B / 2 computed from the same contiguous bytes (low and high
 * nibbles). */
static void full_block(const uint8_t *packed, const uint16_t *scale_zero, const uint16_t *offsets,
                       int64_t n, int64_t k, int64_t gs, int64_t B, int64_t block_row, char *out,
                       int64_t row_bytes, int out_bf16) {
    const int64_t groups = k / gs, esize = out_bf16 ? 2 : 4, half_rows = B / 2;
    static _Thread_local uint8_t tile[INT4_MAX_BLOCK / 2 * MAX_GROUP];
    uint8_t q[MAX_GROUP];
    const uint8_t *src = packed + block_row * k / 2;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rows = src + g * gs * half_rows;
        for (int64_t j = 0; j < gs; j++)
            for (int64_t d = 0; d < half_rows; d++) tile[d * gs + j] = rows[j * half_rows + d];
        for (int64_t d = 0; d < half_rows; d++) {
            for (int half = 0; half < 2; half++) {
                const int64_t r = block_row + d + half_rows * half;
                for (int64_t j = 0; j < gs; j++) q[j] = (uint8_t)(tile[d * gs + j] >> (4 * half));
                group_values(q, gs, bf16_value(scale_zero[2 * (g * n + r)]),
                             bf16_value(offsets[r * groups + g]),
                             out + r * row_bytes + g * gs * esize, out_bf16);
            }
        }
    }
}

/* out [stop - start, k] (float32 if out_bf16 == 0, else bfloat16): rows [start, stop) of the
 * n x k matrix in blocks of B rows; whole blocks by full_block (~4x the speed of reading every
 * code at its stride), the rest by rows_by_stride. Returns 0, or -1 for an unsupported shape. */
int dq_dequantize_int4pack(const uint8_t *packed, const uint16_t *scale_zero,
                           const uint16_t *offsets, int64_t n, int64_t k, int64_t gs, int64_t B,
                           int64_t start, int64_t stop, void *out, int out_bf16) {
    if ((B != 32 && B != 64) || n % 16 != 0 || k % 2 != 0 || gs <= 0 || gs > MAX_GROUP
        || k % gs != 0 || start < 0 || stop > n)
        return -1;
    const int64_t row_bytes = k * (out_bf16 ? 2 : 4);
    char *base = (char *)out - start * row_bytes; /* row r at base + r * row_bytes */
    for (int64_t b = start / B * B; b < stop; b += B) {
        const int64_t rows_here = n - b < B ? n - b : B;
        const int64_t lo = b > start ? b : start, hi = b + rows_here < stop ? b + rows_here : stop;
        if (rows_here == B && lo == b && hi == b + rows_here)
            full_block(packed, scale_zero, offsets, n, k, gs, B, b, base, row_bytes, out_bf16);
        else
            rows_by_stride(packed, scale_zero, offsets, n, k, gs, B, b, rows_here, lo, hi, base,
                           row_bytes, out_bf16);
    }
    return 0;
}

/* The same with whole blocks split over `threads` threads (pool.c). */
typedef struct {
    const uint8_t *packed;
    const uint16_t *scale_zero, *offsets;
    int64_t n, k, gs, B, start, stop;
    char *out;
    int out_bf16;
} int4_job;

static int int4_part(const void *ctx, int64_t b0, int64_t b1) {
    const int4_job *j = ctx;
    const int64_t first = j->start / j->B * j->B;
    int64_t lo = first + b0 * j->B, hi = first + b1 * j->B;
    lo = lo > j->start ? lo : j->start;
    hi = hi < j->stop ? hi : j->stop;
    char *out = j->out + (lo - j->start) * j->k * (j->out_bf16 ? 2 : 4);
    return lo < hi ? dq_dequantize_int4pack(j->packed, j->scale_zero, j->offsets, j->n, j->k,
                                            j->gs, j->B, lo, hi, out, j->out_bf16) : 0;
}

int dq_dequantize_int4pack_mt(const uint8_t *packed, const uint16_t *scale_zero,
                              const uint16_t *offsets, int64_t n, int64_t k, int64_t gs,
                              int64_t B, int64_t start, int64_t stop, void *out, int out_bf16,
                              int threads) {
    if (B != 32 && B != 64) return -1;
    const int64_t first = start / B * B, blocks = (stop - first + B - 1) / B;
    const int4_job j = {.packed = packed, .scale_zero = scale_zero, .offsets = offsets, .n = n,
                        .k = k, .gs = gs, .B = B, .start = start, .stop = stop, .out = out,
                        .out_bf16 = out_bf16};
    return stop > start ? dq_parallel(int4_part, &j, blocks, threads) : 0;
}
