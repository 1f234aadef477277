/* dynquant's packed GEMM for prefill: y = x @ W^T for many tokens (9-512 and more) in float32,
 * reading the packed codes directly, without a float copy of W in memory.
 *
 * W is [rows, padded_n] in groups of gs codes along each row; w = q * scale + offset (float32
 * multiply, then add: the format's dequantization). Rows are taken a strip at a time (NRV rows,
 * two vectors' worth), and a strip a chunk of columns at a time (128 KB of floats): the chunk's
 * codes are unpacked and dequantized once (unpack.h: VBMI, AVX2 or portable) row by row, then
 * transposed 8 x 8 into a per-thread buffer stored k-major (the NRV values of one column k side
 * by side), and every block of MR tokens is multiplied with it in registers: for each k, two
 * vectors of the strip times x[t, k] broadcast, into MR x 2 vector accumulators (fused
 * multiply-adds where the CPU has them). No horizontal sums: a row of accumulators is a row of y.
 * The chunk stays in L2 while the tokens stream past it. A few tokens take panels of rows
 * instead (the dot form).
 *
 * The result is the exact product of x and the dequantized W up to float32 rounding in another
 * summation order than the reference's BLAS (held to it within a stated tolerance).
 */
#include "pool.h"
#include "unpack.h"
#if defined(__AVX2__)
#include <immintrin.h> /* transpose8 */
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
#define MR 12
#define DOT_MR 4
#define DOT_MAX_TOKENS 9
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
#define DOT_MAX_TOKENS 10
#define FMADD(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define BCAST(v) _mm256_set1_ps(v)
#else
typedef float vf __attribute__((vector_size(16)));
#define VW 4
#define MR 6
#define DOT_MR 3
#define DOT_NR 3
#define DOT_MAX_TOKENS 12
#define FMADD(a, b, c) ((a) * (b) + (c))
#define BCAST(v) ((vf){(v), (v), (v), (v)})
#endif

#define NRV (2 * VW)
/* Fewer tokens than DOT_MAX_TOKENS take the dot form (panels of rows stored as rows, each output
 * a vector of partial sums along k summed at the end); more, the strips and register tiles below,
 * which win from about 9 tokens with AVX-512's 12-token tiles and 10 with AVX2's 6-token ones
 * (`benchmarks/packed_products.py`). */
#define PANEL_BYTES (256 * 1024)

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vf(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* out[t][j] (+)= sum_k x[t, k] * strip[k * ldb + j] for MR tokens (rows of x, stride ldx),
 * k < n, j < NRV; `carry`: out holds the sum of earlier columns, added to. The registers sum KC
 * columns at a time and out sums the blocks: float32 error grows with KC + n / KC terms rather
 * than n (at 2048 columns: 2e-6 of the largest output -> 4e-7, the BLAS's). */
#define KC 256
static inline void tile(const float *x, int64_t ldx, const float *strip, int64_t ldb, int64_t n,
                        float out[MR][NRV], int carry) {
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
            if (k0 || carry) {
                acc[t][0] += load_vf(out[t]);
                acc[t][1] += load_vf(out[t] + VW);
            }
            store_vf(out[t], acc[t][0]);
            store_vf(out[t] + VW, acc[t][1]);
        }
    }
}

/* dst[i * ldd + j] = src[j * lds + i] for an 8 x 8 block of floats: one strip column's
 * values of 8 rows side by side. */
static inline void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
#if defined(__AVX2__)
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        s[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
#else
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) dst[i * ldd + j] = src[j * lds + i];
#endif
}

/* Groups [g0, g1) of rows [0, count) of a strip from the packed rows, k-major: strip[k * NRV + j]
 * = w[j, g0 * gs + k]; rows [count, NRV) are zero. A group of every row is dequantized row by row
 * into `rows` (NRV x gs floats, contiguous stores), then transposed into the strip 8 x 8 at a
 * time: storing each value at its k-major place one by one costs more than the products of 64
 * tokens. */
static void dequantize_strip(const uint32_t *qweight, const uint16_t *scales,
                             const uint16_t *offsets, int64_t count, int64_t groups, int64_t g0,
                             int64_t g1, int64_t gs, int bits, int portable, float *strip,
                             float *rows) {
    const int64_t words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    memset(rows + count * gs, 0, (size_t)((NRV - count) * gs) * sizeof(float));
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t j = 0; j < count; j++)
            dequantize_group(&unpack, (const uint8_t *)(qweight + (j * groups + g) * words), gs,
                             scales[j * groups + g], offsets[j * groups + g], rows + j * gs);
        float *dst = strip + (g - g0) * gs * NRV;
        for (int64_t j = 0; j < NRV; j += 8)
            for (int64_t i = 0; i < gs; i += 8)
                transpose8(rows + j * gs + i, gs, dst + i * NRV + j, NRV);
    }
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
                       int64_t rows, int64_t padded_n, int64_t n, int64_t gs, int bits,
                       const float *x, int64_t m, float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    int64_t nb = PANEL_BYTES / (int64_t)sizeof(float) / padded_n / DOT_NR * DOT_NR;
    nb = nb < DOT_NR ? DOT_NR : nb;
    float *panel = thread_buffer((size_t)((nb + DOT_MR) * padded_n));
    if (!panel) return -1;
    float *xtail = panel + nb * padded_n;
    const int64_t m_full = pad_token_tail(x, m, n, DOT_MR, xtail);
    float out[DOT_MR][DOT_NR];
    for (int64_t r0 = 0; r0 < rows; r0 += nb) {
        const int64_t count = rows - r0 < nb ? rows - r0 : nb;
        const int64_t used = (count + DOT_NR - 1) / DOT_NR * DOT_NR;
        dequantize_panel(qweight + r0 * groups * words, scales + r0 * groups, offsets + r0 * groups,
                         count, used, padded_n, gs, bits, portable, panel);
        for (int64_t t0 = 0; t0 < m; t0 += DOT_MR) {
            const float *xt = t0 < m_full ? x + t0 * n : xtail;
            const int64_t mt = m - t0 < DOT_MR ? m - t0 : DOT_MR;
            for (int64_t r = 0; r < used; r += DOT_NR) {
                tile_dot(xt, n, panel + r * padded_n, padded_n, n, out);
                const int64_t nr = count - r < DOT_NR ? count - r : DOT_NR;
                for (int64_t t = 0; t < mt; t++)
                    for (int64_t i = 0; i < nr; i++) y[(t0 + t) * y_stride + r0 + r + i] = out[t][i];
            }
        }
    }
    return 0;
}

/* Strips of NRV rows, each STRIP_KC columns (or one longer group) at a time: the chunk's k-major
 * values (128 KB) are dequantized and every block of MR tokens passes them while they
 * are in L2 (a whole-row strip of a 4096-wide matrix, 512 KB, is evicted by the tokens streaming
 * past). y carries each
 * token block's sums from chunk to chunk, in the order `tile` adds its KC blocks: the same bits
 * as one pass over the whole row, a chunk being a whole number of KC blocks for the format's
 * group sizes (32, 64, 128; others would sum in another order, as exactly). */
#define STRIP_KC (32 * 1024 / NRV)
static int gemm_strips(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t padded_n, int64_t n, int64_t gs, int bits,
                       const float *x, int64_t m, float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    const int64_t chunk_groups = gs < STRIP_KC ? STRIP_KC / gs : 1;
    float *strip = thread_buffer((size_t)(NRV * chunk_groups * gs + MR * padded_n + NRV * gs));
    if (!strip) return -1;
    float *xtail = strip + NRV * chunk_groups * gs, *rows_buf = xtail + MR * padded_n;
    const int64_t m_full = pad_token_tail(x, m, n, MR, xtail);
    float out[MR][NRV];
    for (int64_t r0 = 0; r0 < rows; r0 += NRV) {
        const int64_t count = rows - r0 < NRV ? rows - r0 : NRV;
        for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
            const int64_t g1 = groups - g0 < chunk_groups ? groups : g0 + chunk_groups;
            /* the padding's columns (past n) are not multiplied: x has none */
            const int64_t k0 = g0 * gs, kn = ((g1 - g0) * gs < n - k0 ? (g1 - g0) * gs : n - k0);
            dequantize_strip(qweight + r0 * groups * words, scales + r0 * groups,
                             offsets + r0 * groups, count, groups, g0, g1, gs, bits, portable,
                             strip, rows_buf);
            for (int64_t t0 = 0; t0 < m; t0 += MR) {
                const float *xt = (t0 < m_full ? x + t0 * n : xtail) + k0;
                const int64_t mt = m - t0 < MR ? m - t0 : MR;
                if (k0)
                    for (int64_t t = 0; t < mt; t++)
                        memcpy(out[t], y + (t0 + t) * y_stride + r0, (size_t)count * sizeof(float));
                tile(xt, n, strip, NRV, kn, out, k0 > 0);
                for (int64_t t = 0; t < mt; t++)
                    memcpy(y + (t0 + t) * y_stride + r0, out[t], (size_t)count * sizeof(float));
            }
        }
    }
    return 0;
}

/* y [m, rows] (row stride y_stride) for a block of rows; x [m, n] float32, n the columns
 * multiplied: padded_n, or fewer (the unpadded in_features, a multiple of the vector width VW:
 * the caller then has no padding to copy, and its columns are not multiplied). portable != 0
 * forces the portable unpacking. Returns 0, or -1 if out of memory or gs or n is unsupported. */
int dq_gemm(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
            int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t n,
            int64_t m, float *y, int64_t y_stride, int portable) {
    if (gs > MAX_GROUP || gs % 32 != 0 || n > padded_n || n <= padded_n - gs || n % VW != 0)
        return -1;
    return (m < DOT_MAX_TOKENS ? gemm_panels : gemm_strips)(qweight, scales, offsets, rows,
                                                            padded_n, n, gs, bits, x, m, y,
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
                tile(xt, rows, panel + j, gs, rows, out, 0);
                for (int64_t t = 0; t < mt; t++)
                    memcpy(y + (t0 + t) * padded_n + g * gs + j, out[t], NRV * sizeof(float));
            }
        }
    }
    return 0;
}

/* Both GEMMs with their rows (dq_gemm) or groups (dq_gemm_t) split over `threads` threads
 * (pool.c): a Python pool's hand-off costs a fifth of a small model's product. */
typedef struct {
    dq_job job;
    int64_t n; /* x's columns (dq_gemm's n) */
} gemm_job;

static int gemm_rows_part(const void *ctx, int64_t lo, int64_t hi) {
    const gemm_job *g = ctx;
    const dq_job *j = &g->job;
    const int64_t groups = j->padded_n / j->gs, words = j->bits * j->gs / 32;
    return dq_gemm(j->qweight + lo * groups * words, j->scales + lo * groups,
                   j->offsets + lo * groups, hi - lo, j->padded_n, j->gs, j->bits, j->x, g->n,
                   j->m, j->y + lo, j->y_stride, j->portable);
}

int dq_gemm_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
               int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t n,
               int64_t m, float *y, int64_t y_stride, int portable, int threads) {
    const gemm_job g = {.job = {.qweight = qweight, .scales = scales, .offsets = offsets,
                                .rows = rows, .padded_n = padded_n, .gs = gs, .bits = bits,
                                .portable = portable, .x = x, .m = m, .y = y,
                                .y_stride = y_stride},
                        .n = n};
    return dq_parallel(gemm_rows_part, &g, rows, threads);
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
