/* dynquant's packed GEMM for prefill: y = x @ W^T for many tokens (9-512 and more) in float32,
 * reading the packed codes directly, without a float copy of W in memory.
 *
 * W is [rows, padded_n] in groups of gs codes along each row; w = q * scale + offset (float32
 * multiply, then add: the format's dequantization). Rows are taken a panel at a time (NB rows,
 * at most PANEL_BYTES of float32, so the panel stays in L2): the panel's codes are unpacked and
 * dequantized once (unpack.h: VBMI, AVX2 or portable), then every token is multiplied with it in
 * register tiles of MR tokens x NR rows, each output a vector of VW partial sums along k (fused
 * multiply-adds where the CPU has them) summed once at the end of the row. The tokens' rows of x
 * (MR x padded_n) are reused from L1/L2 by every tile of the panel.
 *
 * The result is the exact product of x and the dequantized W up to float32 rounding in another
 * summation order than the reference's BLAS (held to it within a stated tolerance).
 */
#include "unpack.h"

#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
#define VW 16
#define MR 4
#define NR 4
#define FMADD(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
#define VW 8
#define MR 3
#define NR 3
#define FMADD(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#else
typedef float vf __attribute__((vector_size(16)));
#define VW 4
#define MR 3
#define NR 3
#define FMADD(a, b, c) ((a) * (b) + (c))
#endif

#define PANEL_BYTES (256 * 1024)

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_vf(vf v) {
    float lanes[VW], s = 0.0f;
    memcpy(lanes, &v, sizeof v);
    for (int l = 0; l < VW; l++) s += lanes[l];
    return s;
}

/* One tile: y[t, r] = x[t, :] . w[r, :] for MR tokens (rows of x, stride ldx) and NR rows of the
 * panel (stride ldw), all of length n (a multiple of VW). */
static inline void tile(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t n,
                        float out[MR][NR]) {
    vf acc[MR][NR];
    for (int t = 0; t < MR; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = (vf){0};
    for (int64_t k = 0; k < n; k += VW) {
        vf xv[MR];
        for (int t = 0; t < MR; t++) xv[t] = load_vf(x + t * ldx + k);
        for (int r = 0; r < NR; r++) {
            const vf wv = load_vf(w + r * ldw + k);
            for (int t = 0; t < MR; t++) acc[t][r] = FMADD(xv[t], wv, acc[t][r]);
        }
    }
    for (int t = 0; t < MR; t++)
        for (int r = 0; r < NR; r++) out[t][r] = sum_vf(acc[t][r]);
}

/* Rows [0, count) of the panel from the packed rows; rows [count, nb) are zero. */
static void dequantize_panel(const uint32_t *qweight, const uint16_t *scales,
                             const uint16_t *offsets, int64_t count, int64_t nb, int64_t padded_n,
                             int64_t gs, int bits, int portable, float *panel) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    const group_unpacker unpack = make_group_unpacker(bits, portable);
    for (int64_t r = 0; r < count; r++)
        for (int64_t g = 0; g < groups; g++) {
            float *dst = panel + r * padded_n + g * gs;
            unpack_codes_as_floats(&unpack, (const uint8_t *)(qweight + (r * groups + g) * words),
                                   gs, dst);
            const float s = bf16_value(scales[r * groups + g]), o = bf16_value(offsets[r * groups + g]);
            for (int64_t j = 0; j < gs; j++) dst[j] = dst[j] * s + o;
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

/* y [m, rows] (row stride y_stride) for a block of rows; x [m, padded_n] float32, zero in the
 * padding. portable != 0 forces the portable unpacking. Returns 0, or -1 if out of memory or gs
 * is unsupported. */
int dq_gemm(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
            int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
            float *y, int64_t y_stride, int portable) {
    const int64_t groups = padded_n / gs, words = bits * gs / 32;
    if (gs > MAX_GROUP || gs % 32 != 0 || padded_n % VW != 0) return -1;
    int64_t nb = PANEL_BYTES / (int64_t)sizeof(float) / padded_n / NR * NR;
    nb = nb < NR ? NR : nb;
    float *panel = thread_buffer((size_t)((nb + MR) * padded_n));
    if (!panel) return -1;
    float *xtail = panel + nb * padded_n; /* the last partial block of tokens, zero-padded */
    const int64_t m_full = m - m % MR;
    if (m_full < m) {
        memcpy(xtail, x + m_full * padded_n, (size_t)((m - m_full) * padded_n) * sizeof(float));
        memset(xtail + (m - m_full) * padded_n, 0, (size_t)((MR - (m - m_full)) * padded_n) * sizeof(float));
    }
    float out[MR][NR];
    for (int64_t r0 = 0; r0 < rows; r0 += nb) {
        const int64_t count = rows - r0 < nb ? rows - r0 : nb;
        const int64_t used = (count + NR - 1) / NR * NR;
        dequantize_panel(qweight + r0 * groups * words, scales + r0 * groups, offsets + r0 * groups,
                         count, used, padded_n, gs, bits, portable, panel);
        for (int64_t t0 = 0; t0 < m; t0 += MR) {
            const float *xt = t0 < m_full ? x + t0 * padded_n : xtail;
            const int64_t mt = m - t0 < MR ? m - t0 : MR;
            for (int64_t r = 0; r < used; r += NR) {
                tile(xt, padded_n, panel + r * padded_n, padded_n, padded_n, out);
                const int64_t nr = count - r < NR ? count - r : NR;
                for (int64_t t = 0; t < mt; t++)
                    for (int64_t i = 0; i < nr; i++) y[(t0 + t) * y_stride + r0 + r + i] = out[t][i];
            }
        }
    }
    return 0;
}

/* The register tile the kernel was built with: MR tokens x NR rows x VW lanes. */
int dq_gemm_tile(void) { return MR * 10000 + NR * 100 + VW; }
