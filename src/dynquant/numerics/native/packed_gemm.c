/* dynquant's packed GEMM for prefill: y = x @ W^T for many tokens (9-512 and more) in float32,
 * reading the packed codes directly, without a float copy of W in memory.
 *
 * W is [rows, padded_n] in groups of gs codes along each row; w = q * scale + offset (float32
 * multiply, then add: the format's dequantization). Rows are taken a strip at a time (NRV rows,
 * two vectors' worth): the strip's codes are unpacked and dequantized once (unpack.h: VBMI, AVX2
 * or portable) into a per-thread buffer, stored k-major (the NRV values of one column k side by
 * side), then every block of MR tokens is multiplied with it in registers: for each k, two
 * vectors of the strip times x[t, k] broadcast, into MR x 2 vector accumulators (fused
 * multiply-adds where the CPU has them). No horizontal sums: a row of accumulators is a row of y.
 * The strip (NRV x padded_n floats, 256-512 KB at 4096 columns) stays in L2 while the tokens
 * stream past it.
 *
 * The result is the exact product of x and the dequantized W up to float32 rounding in another
 * summation order than the reference's BLAS (held to it within a stated tolerance).
 */
#include "pool.h"
#include "unpack.h"

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
#define MR 12
#define DOT_MR 4
#define DOT_NR 4
#define FMADD(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define BCAST(v) _mm512_set1_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
#define MR 6
#define DOT_MR 3
#define DOT_NR 3
#define FMADD(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define BCAST(v) _mm256_set1_ps(v)
#else
typedef float vf __attribute__((vector_size(16)));
#define VW 4
#define MR 6
#define DOT_MR 3
#define DOT_NR 3
#define FMADD(a, b, c) ((a) * (b) + (c))
#define BCAST(v) ((vf){(v), (v), (v), (v)})
#endif

#define NRV (2 * VW)
/* Fewer tokens than this take the dot form (panels of rows stored as rows: dequantized with
 * contiguous stores, each output a vector of partial sums along k summed at the end): below it
 * the k-major strip's scattered stores cost more than they save (4096 x 4096, 9 tokens: 2.5 vs
 * 5.7 ms with AVX-512). */
#define DOT_MAX_TOKENS (2 * MR)
#define PANEL_BYTES (256 * 1024)

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vf(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* out[t][j] = sum_k x[t, k] * strip[k * ldb + j] for MR tokens (rows of x, stride ldx), k < n,
 * j < NRV. The
 * registers sum KC columns at a time and out sums the blocks: float32 error grows with KC +
 * n / KC terms rather than n (at 2048 columns: 2e-6 of the largest output -> 4e-7, the BLAS's). */
#define KC 256
static inline void tile(const float *x, int64_t ldx, const float *strip, int64_t ldb, int64_t n,
                        float out[MR][NRV]) {
    for (int64_t k0 = 0; k0 < n; k0 += KC) {
        const int64_t k1 = n - k0 < KC ? n : k0 + KC;
        vf acc[MR][2];
        for (int t = 0; t < MR; t++) acc[t][0] = acc[t][1] = BCAST(0.0f);
        for (int64_t k = k0; k < k1; k++) {
            const vf b0 = load_vf(strip + k * ldb), b1 = load_vf(strip + k * ldb + VW);
            for (int t = 0; t < MR; t++) {
                const vf xv = BCAST(x[t * ldx + k]);
                acc[t][0] = FMADD(xv, b0, acc[t][0]);
                acc[t][1] = FMADD(xv, b1, acc[t][1]);
            }
        }
        for (int t = 0; t < MR; t++) {
            if (k0) {
                acc[t][0] += load_vf(out[t]);
                acc[t][1] += load_vf(out[t] + VW);
            }
            store_vf(out[t], acc[t][0]);
            store_vf(out[t] + VW, acc[t][1]);
        }
    }
}

/* Rows [0, count) of a strip from the packed rows, k-major: strip[k * NRV + j] = w[j, k];
 * rows [count, NRV) are zero. */
static void dequantize_strip(const uint32_t *qweight, const uint16_t *scales,
                             const uint16_t *offsets, int64_t count, int64_t padded_n,
                             int64_t gs, int bits, int portable, float *strip) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    float q[MAX_GROUP];
    for (int64_t j = 0; j < count; j++)
        for (int64_t g = 0; g < groups; g++) {
            dequantize_group(&unpack, (const uint8_t *)(qweight + (j * groups + g) * words), gs,
                             scales[j * groups + g], offsets[j * groups + g], q);
            float *dst = strip + g * gs * NRV + j;
            for (int64_t i = 0; i < gs; i++) dst[i * NRV] = q[i];
        }
    for (int64_t j = count; j < NRV; j++)
        for (int64_t k = 0; k < padded_n; k++) strip[k * NRV + j] = 0.0f;
}

static inline float sum_vf(vf v) {
    float lanes[VW], s = 0.0f;
    memcpy(lanes, &v, sizeof v);
    for (int l = 0; l < VW; l++) s += lanes[l];
    return s;
}

/* Dot form: out[t][r] = x[t, :] . w[r, :] for DOT_MR tokens and DOT_NR rows of a row-major
 * panel (stride ldw), k < n (a multiple of VW). */
static inline void tile_dot(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t n,
                            float out[DOT_MR][DOT_NR]) {
    vf acc[DOT_MR][DOT_NR];
    for (int t = 0; t < DOT_MR; t++)
        for (int r = 0; r < DOT_NR; r++) acc[t][r] = BCAST(0.0f);
    for (int64_t k = 0; k < n; k += VW) {
        vf xv[DOT_MR];
        for (int t = 0; t < DOT_MR; t++) xv[t] = load_vf(x + t * ldx + k);
        for (int r = 0; r < DOT_NR; r++) {
            const vf wv = load_vf(w + r * ldw + k);
            for (int t = 0; t < DOT_MR; t++) acc[t][r] = FMADD(xv[t], wv, acc[t][r]);
        }
    }
    for (int t = 0; t < DOT_MR; t++)
        for (int r = 0; r < DOT_NR; r++) out[t][r] = sum_vf(acc[t][r]);
}

/* Rows [0, count) of a row-major panel; rows [count, nb) are zero. */
static void dequantize_panel(const uint32_t *qweight, const uint16_t *scales,
                             const uint16_t *offsets, int64_t count, int64_t nb, int64_t padded_n,
                             int64_t gs, int bits, int portable, float *panel) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    for (int64_t r = 0; r < count; r++)
        for (int64_t g = 0; g < groups; g++) {
            dequantize_group(&unpack, (const uint8_t *)(qweight + (r * groups + g) * words), gs,
                             scales[r * groups + g], offsets[r * groups + g],
                             panel + r * padded_n + g * gs);
        }
    memset(panel + count * padded_n, 0, (size_t)((nb - count) * padded_n) * sizeof(float));
}

/* A buffer per thread, kept for the thread's life (a fresh one per call costs page faults). */
static float *thread_buffer(size_t floats) {
    static _Thread_local float *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

/* The last partial block of tokens (m % mr of them), zero-padded to mr rows of ld floats, into
 * xtail: the tiles always multiply mr tokens. Returns the tokens in whole blocks. */
static int64_t pad_token_tail(const float *x, int64_t m, int64_t ld, int64_t mr, float *xtail) {
    const int64_t m_full = m - m % mr;
    if (m_full < m) {
        memcpy(xtail, x + m_full * ld, (size_t)((m - m_full) * ld) * sizeof(float));
        memset(xtail + (m - m_full) * ld, 0, (size_t)((mr - (m - m_full)) * ld) * sizeof(float));
    }
    return m_full;
}

static int gemm_panels(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                       int64_t m, float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    int64_t nb = PANEL_BYTES / (int64_t)sizeof(float) / padded_n / DOT_NR * DOT_NR;
    nb = nb < DOT_NR ? DOT_NR : nb;
    float *panel = thread_buffer((size_t)((nb + DOT_MR) * padded_n));
    if (!panel) return -1;
    float *xtail = panel + nb * padded_n;
    const int64_t m_full = pad_token_tail(x, m, padded_n, DOT_MR, xtail);
    float out[DOT_MR][DOT_NR];
    for (int64_t r0 = 0; r0 < rows; r0 += nb) {
        const int64_t count = rows - r0 < nb ? rows - r0 : nb;
        const int64_t used = (count + DOT_NR - 1) / DOT_NR * DOT_NR;
        dequantize_panel(qweight + r0 * groups * words, scales + r0 * groups, offsets + r0 * groups,
                         count, used, padded_n, gs, bits, portable, panel);
        for (int64_t t0 = 0; t0 < m; t0 += DOT_MR) {
            const float *xt = t0 < m_full ? x + t0 * padded_n : xtail;
            const int64_t mt = m - t0 < DOT_MR ? m - t0 : DOT_MR;
            for (int64_t r = 0; r < used; r += DOT_NR) {
                tile_dot(xt, padded_n, panel + r * padded_n, padded_n, padded_n, out);
                const int64_t nr = count - r < DOT_NR ? count - r : DOT_NR;
                for (int64_t t = 0; t < mt; t++)
                    for (int64_t i = 0; i < nr; i++) y[(t0 + t) * y_stride + r0 + r + i] = out[t][i];
            }
        }
    }
    return 0;
}

static int gemm_strips(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                       int64_t m, float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    float *strip = thread_buffer((size_t)((NRV + MR) * padded_n));
    if (!strip) return -1;
    float *xtail = strip + NRV * padded_n;
    const int64_t m_full = pad_token_tail(x, m, padded_n, MR, xtail);
    float out[MR][NRV];
    for (int64_t r0 = 0; r0 < rows; r0 += NRV) {
        const int64_t count = rows - r0 < NRV ? rows - r0 : NRV;
        dequantize_strip(qweight + r0 * groups * words, scales + r0 * groups, offsets + r0 * groups,
                         count, padded_n, gs, bits, portable, strip);
        for (int64_t t0 = 0; t0 < m; t0 += MR) {
            const float *xt = t0 < m_full ? x + t0 * padded_n : xtail;
            const int64_t mt = m - t0 < MR ? m - t0 : MR;
            tile(xt, padded_n, strip, NRV, padded_n, out);
            for (int64_t t = 0; t < mt; t++)
                memcpy(y + (t0 + t) * y_stride + r0, out[t], (size_t)count * sizeof(float));
        }
    }
    return 0;
}

/* y [m, rows] (row stride y_stride) for a block of rows; x [m, padded_n] float32, zero in the
 * padding. portable != 0 forces the portable unpacking. Returns 0, or -1 if out of memory or gs
 * is unsupported. */
int dq_gemm(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
            int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
            float *y, int64_t y_stride, int portable) {
    if (gs > MAX_GROUP || gs % 32 != 0) return -1;
    return (m < DOT_MAX_TOKENS ? gemm_panels : gemm_strips)(qweight, scales, offsets, rows,
                                                            padded_n, gs, bits, x, m, y,
                                                            y_stride, portable);
}

/* Groups [g0, g1) of a group's columns of every row: panel[h * gs + j] = w[h, g * gs + j]. */
static void dequantize_group_columns(const uint32_t *qweight, const uint16_t *scales,
                                     const uint16_t *offsets, int64_t rows, int64_t groups,
                                     int64_t g, int64_t gs, int bits, int portable, float *panel) {
    const int64_t words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    for (int64_t h = 0; h < rows; h++)
        dequantize_group(&unpack, (const uint8_t *)(qweight + (h * groups + g) * words), gs,
                         scales[h * groups + g], offsets[h * groups + g], panel + h * gs);
}

/* y = x @ W for many tokens, W [rows, padded_n] stored in groups along its rows (the output
 * dimension: expert banks used as x @ W[e]); x [m, rows], y [m, padded_n], groups [g0, g1).
 * A group's columns of every row are dequantized into a panel that is already k-major (k = the
 * row), and the same register tiles run over it, NRV columns at a time. */
int dq_gemm_t(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable) {
    const int64_t groups = padded_n / gs;
    if (gs > MAX_GROUP || gs % NRV != 0) return -1;
    float *panel = thread_buffer((size_t)(rows * gs + MR * rows));
    if (!panel) return -1;
    float *xtail = panel + rows * gs;
    const int64_t m_full = pad_token_tail(x, m, rows, MR, xtail);
    float out[MR][NRV];
    for (int64_t g = g0; g < g1; g++) {
        dequantize_group_columns(qweight, scales, offsets, rows, groups, g, gs, bits, portable, panel);
        for (int64_t t0 = 0; t0 < m; t0 += MR) {
            const float *xt = t0 < m_full ? x + t0 * rows : xtail;
            const int64_t mt = m - t0 < MR ? m - t0 : MR;
            for (int64_t j = 0; j < gs; j += NRV) {
                tile(xt, rows, panel + j, gs, rows, out);
                for (int64_t t = 0; t < mt; t++)
                    memcpy(y + (t0 + t) * padded_n + g * gs + j, out[t], NRV * sizeof(float));
            }
        }
    }
    return 0;
}

/* Both GEMMs with their rows (dq_gemm) or groups (dq_gemm_t) split over `threads` threads
 * (pool.c): the Python pool's ~50 us hand-off was a fifth of a small model's product. */
int dq_gemm_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
               int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
               float *y, int64_t y_stride, int portable, int threads) {
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .rows = rows,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable, .x = x,
                      .m = m, .y = y, .y_stride = y_stride};
    return dq_parallel_rows(dq_gemm, &j, threads);
}

int dq_gemm_t_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int portable, int threads) {
    const dq_job j = {.qweight = qweight, .scales = scales, .offsets = offsets, .rows = rows,
                      .padded_n = padded_n, .gs = gs, .bits = bits, .portable = portable, .x = x,
                      .m = m, .y = y};
    return dq_parallel_groups(dq_gemm_t, &j, threads);
}

/* The register tile the kernel was built with: MR tokens x NRV rows (NRV = 2 vectors of VW). */
int dq_gemm_tile(void) { return MR * 10000 + NRV * 100 + VW; }
