/* One decode step of a Llama-style decoder (Llama, Qwen3; Qwen3-MoE, Mixtral, OLMoE; LFM2, whose
 * layers are attention or gated short convolutions) in one call: every layer's norms, products,
 * rotary embedding, attention over the cache (or the convolution over its state) and MLP (dense,
 * or routed experts of packed banks), then the final norm and the head.
 * A decode step through transformers' modules pays a Python dispatch per norm, rotary, cat and
 * module call (hundreds per token); here Python makes one call a token.
 *
 * Arithmetic is float32. Products are dynquant's one-token kernels (packed_matvec.c,
 * packed_matvec_q8.c) or, for a matrix kept dense, a float32 / bf16 matvec below. The rest
 * follows transformers' definitions: RMSNorm x * rsqrt(mean(x^2) + eps) * w; rotary with
 * cos/sin(pos * inv_freq) * attention_scaling on the two halves of each head (rotate_half);
 * softmax attention over the cached positions 0..pos with grouped key/value heads (a key/value
 * head's block of positions a unit of work, merged in order: attend_blocks); SiLU-gated MLP;
 * MoE: softmax of the router's logits, the top k (ties: the lower expert), their weights
 * renormalised where asked, each routed expert's SiLU-gated MLP by packed_experts.c's pair
 * kernels (dq_experts_one) and the weighted sum in slot order; LFM2-MoE's router instead: the
 * sigmoid of the logits, the top k of sigmoid + expert bias, their sigmoids as weights
 * (renormalised with 1e-6 beside the sum where asked), times the routed scaling factor; the
 * reference hybrid's experts multiply x @ W[e] (separate gate and up banks) beside a shared
 * expert. LFM2's (and the hybrid's) short convolution: B, C, x = the in projection's three
 * thirds; the state takes B * x as its newest of K values (the oldest drops); y = C * (bias +
 * sum_j w[j] * state[j]); the out projection.
 *
 * The program, its layers and products are kernels.h's descriptors (built by
 * runtime/native_decode.py).
 * Norm weights are float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "kernels.h"
#include "pool.h"

/* A dense row . x in 16 lanes (the compiler vectorises the lanes; no reassociation needed). */
static float dense_dot_f32(const float *w, const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) acc[l] += w[j + l] * x[j + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; j < n; j++) s += w[j] * x[j];
    return s;
}

static int product(const dq_product *p, const float *x, float *y) {
    int rc = 0;
    switch (p->kind) {
    case DQ_PRODUCT_PACKED: rc = dq_matvec_one(p->weight, x, y); break;
    case DQ_PRODUCT_PACKED_Q8: rc = dq_matvec_q8_one(p->weight, x, y); break;
    case DQ_PRODUCT_PACKED_Q16: rc = dq_matvec_q16_one(p->weight, x, y); break;
    case DQ_PRODUCT_DENSE_F32:
        for (int64_t r = 0; r < p->rows; r++)
            y[r] = dense_dot_f32((const float *)p->weight + r * p->cols, x, p->cols);
        break;
    case DQ_PRODUCT_DENSE_BF16:
        rc = dq_dense_matvec_bf16_mt(p->weight, p->rows, p->cols, x, 1, y, p->rows, p->threads);
        break;
    default: return -1;
    }
    if (p->bias)
        for (int64_t r = 0; r < p->rows; r++) y[r] += p->bias[r];
    return rc;
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) acc[l] += x[j + l] * x[j + l];
    float ss = 0.0f;
    for (int l = 0; l < 16; l++) ss += acc[l];
    for (; j < n; j++) ss += x[j] * x[j];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (j = 0; j < n; j++) out[j] = w[j] * (x[j] * inv);
}

/* rotate_half rotary on `count` heads of head_dim values, cos/sin precomputed. */
static void rotary(float *v, int64_t count, int64_t hd, const float *cs, const float *sn) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < count; h++) {
        float *q = v + h * hd;
        for (int64_t i = 0; i < half; i++) {
            const float a = q[i], b = q[i + half];
            q[i] = a * cs[i] - b * sn[i];
            q[i + half] = b * cs[i] + a * sn[i];
        }
    }
}

/* exp(x) for x <= 0 (a score minus its row's max) in plain float and integer operations that
 * the compiler vectorises (expf is a call per element: at 8,192 cached positions it was most of
 * a step): x = n ln2 + r with |r| <= ln2 / 2 (n rounded by adding and subtracting 1.5 * 2^23),
 * exp(r) by Cephes' degree-6 polynomial, 2^n written into the exponent bits; below 2^-126 the
 * result is 0, against weights of at least 1 (the max's own). No comparison of floats: without
 * -ffast-math one keeps the loop scalar. */
static inline float exp_nonpositive(float x) {
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t ni = (int32_t)n;
    const int32_t bits = ni < -126 ? 0 : (ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Positions a unit of attention work covers: a fixed number (not a share of the threads), so
 * that the partial sums and their merge, and the bits, are the same on any number of threads. */
#define ATTENTION_BLOCK 128
#define MAX_GROUP 64 /* query heads per key/value head */

/* One token's attention over the cache (keys, values: [kv_heads, capacity, hd], a head's
 * positions in a row). A unit of work is one key/value head over one block of positions: every
 * query head of its group scores the block's keys (each key read once for the group), and
 * keeps the block's max m, sum l of exp(score - m) and sum of exp(score - m) v in its partial
 * [hd + 2]; ``attention_merge`` combines a head's blocks in order (flash-decoding). */
typedef struct {
    const float *q;
    const void *kc, *vc; /* float32, or float16 when half */
    int64_t len, capacity, heads, kv_heads, hd;
    float scale;
    float *scores; /* [heads, len] */
    float *part;   /* [heads, blocks, hd + 2] */
    int half;
} attention_job;

#define MAX_HEAD_DIM 512

/* Row t of a key/value head's cache as float32: the row itself, or converted into buf. */
static inline const float *cache_row(const void *cache, int half, int64_t row, int64_t hd,
                                     float *buf) {
    if (!half) return (const float *)cache + row * hd;
    const uint16_t *r = (const uint16_t *)cache + row * hd;
    int64_t d = 0;
#ifdef __F16C__ /* the compiler does not vectorise _Float16 conversions without AVX512-FP16 */
    for (; d + 8 <= hd; d += 8)
        _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + d))));
#endif
    for (; d < hd; d++) {
        _Float16 v;
        memcpy(&v, r + d, sizeof v);
        buf[d] = (float)v;
    }
    return buf;
}

static inline void cache_store(void *cache, int half, int64_t row, int64_t hd, const float *x) {
    if (!half) {
        memcpy((float *)cache + row * hd, x, (size_t)hd * sizeof(float));
        return;
    }
    _Float16 *r = (_Float16 *)cache + row * hd;
    for (int64_t d = 0; d < hd; d++) r[d] = (_Float16)x[d]; /* round to nearest even */
}

/* The attention over a float16 cache in vectors of ATT_W floats: 16 (AVX-512) or 8 (AVX2). */
#if defined(__AVX512F__) && defined(__F16C__)
#define ATT_W 16
typedef __m512 att_vec;
#define att_zero() _mm512_setzero_ps()
#define att_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define att_load(p) _mm512_loadu_ps(p)
#define att_store(p, v) _mm512_storeu_ps(p, v)
#define att_add(a, b) _mm512_add_ps(a, b)
#define att_mul(a, b) _mm512_mul_ps(a, b)
#define att_set1(x) _mm512_set1_ps(x)
#define att_sum(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__F16C__)
#define ATT_W 8
typedef __m256 att_vec;
#define att_zero() _mm256_setzero_ps()
#define att_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define att_load(p) _mm256_loadu_ps(p)
#define att_store(p, v) _mm256_storeu_ps(p, v)
#define att_add(a, b) _mm256_add_ps(a, b)
#define att_mul(a, b) _mm256_mul_ps(a, b)
#define att_set1(x) _mm256_set1_ps(x)
static inline float att_sum(__m256 v) { /* halves, then pairs: a fixed order */
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

#ifdef ATT_W
#define ATT_COLUMNS 64 /* value columns whose sums a block holds in registers */
/* The scores of positions [t0, t1) of one key/value head's float16 keys (row t at keys + t hd,
 * hd a multiple of ATT_W) for the ``group`` query heads at q (hd apart), into s[i][t]: each dot
 * in ATT_W lanes (mul, then add, over the row's blocks in order), the lanes summed in a fixed
 * vector order. The plain loop (a dense_dot_f32 a score) took two thirds of a cached position's
 * time, inlined or not, its lanes summed in turn or folded: the compiler's code for it, not the
 * arithmetic, was the cost (BENCHMARKS.md "Decode after a long context"). */
static void block_scores_half(const uint16_t *keys, int64_t t0, int64_t t1, int64_t hd,
                              const float *q, int64_t group, float scale, float *const *s) {
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *r = keys + t * hd;
        for (int64_t i = 0; i < group; i++) {
            const float *qi = q + i * hd;
            att_vec acc = att_zero();
            for (int64_t d = 0; d < hd; d += ATT_W)
                acc = att_add(acc, att_mul(att_half(r + d), att_load(qi + d)));
            s[i][t] = att_sum(acc) * scale;
        }
    }
}

/* o_i[d] = sum over t in [t0, t1) of p_i[t] v[t][d] (mul, then add, in the order of t) for the
 * ``group`` query heads, p_i = s[i], o_i at out + i * stride, from float16 values (row t at
 * values + t hd, hd a multiple of ATT_W): ATT_COLUMNS columns at a time, their sums held in
 * registers over the block's rows (each head converts the rows again: cheaper than sums kept
 * in memory, a load and a store a row). */
static void block_values_half(const uint16_t *values, int64_t t0, int64_t t1, int64_t hd,
                              int64_t group, float *const *s, float *out,
                              int64_t stride) {
    for (int64_t d = 0; d < hd; d += ATT_COLUMNS) {
        const int64_t n = (hd - d < ATT_COLUMNS ? hd - d : ATT_COLUMNS) / ATT_W;
        for (int64_t i = 0; i < group; i++) {
            att_vec acc[ATT_COLUMNS / ATT_W];
            for (int64_t k = 0; k < n; k++) acc[k] = att_zero();
            for (int64_t t = t0; t < t1; t++) {
                const att_vec p = att_set1(s[i][t]);
                const uint16_t *r = values + t * hd + d;
                for (int64_t k = 0; k < n; k++)
                    acc[k] = att_add(acc[k], att_mul(p, att_half(r + ATT_W * k)));
            }
            for (int64_t k = 0; k < n; k++) att_store(out + i * stride + d + ATT_W * k, acc[k]);
        }
    }
}
#endif

static int attend_blocks(const void *ctx, int64_t lo, int64_t hi) {
    const attention_job *a = ctx;
    const int64_t hd = a->hd, group = a->heads / a->kv_heads;
    const int64_t blocks = (a->len + ATTENTION_BLOCK - 1) / ATTENTION_BLOCK;
#ifdef ATT_W
    const int vectors = a->half && hd % ATT_W == 0; /* block_scores_half, block_values_half */
#else
    const int vectors = 0;
#endif
    for (int64_t unit = lo; unit < hi; unit++) {
        const int64_t g = unit / blocks, b = unit % blocks;
        const int64_t t0 = b * ATTENTION_BLOCK;
        const int64_t t1 = t0 + ATTENTION_BLOCK < a->len ? t0 + ATTENTION_BLOCK : a->len;
        const int64_t first = g * a->capacity; /* the head's row 0 */
        float *s[MAX_GROUP], buf[MAX_HEAD_DIM];
        for (int64_t i = 0; i < group; i++) s[i] = a->scores + (g * group + i) * a->len;
#ifdef ATT_W
        if (vectors)
            block_scores_half((const uint16_t *)a->kc + first * hd, t0, t1, hd,
                              a->q + g * group * hd, group, a->scale, s);
        else
#endif
            for (int64_t t = t0; t < t1; t++) {
                const float *kt = cache_row(a->kc, a->half, first + t, hd, buf);
                for (int64_t i = 0; i < group; i++)
                    s[i][t] = dense_dot_f32(kt, a->q + (g * group + i) * hd, hd) * a->scale;
            }
        for (int64_t i = 0; i < group; i++) {
            float *st = s[i], *pt = a->part + ((g * group + i) * blocks + b) * (hd + 2);
            float mx = st[t0];
            for (int64_t t = t0 + 1; t < t1; t++) mx = st[t] > mx ? st[t] : mx;
            for (int64_t t = t0; t < t1; t++) st[t] = exp_nonpositive(st[t] - mx);
            float acc[16] = {0};
            int64_t t = t0;
            for (; t + 16 <= t1; t += 16)
                for (int l = 0; l < 16; l++) acc[l] += st[t + l];
            float sum = 0.0f;
            for (int l = 0; l < 16; l++) sum += acc[l];
            for (; t < t1; t++) sum += st[t];
            pt[0] = mx;
            pt[1] = sum;
            if (!vectors) /* the plain loop below adds into them; the vectors store theirs */
                for (int64_t d = 0; d < hd; d++) pt[2 + d] = 0.0f;
        }
#ifdef ATT_W
        if (vectors) {
            block_values_half((const uint16_t *)a->vc + first * hd, t0, t1, hd, group, s,
                              a->part + (g * group * blocks + b) * (hd + 2) + 2,
                              blocks * (hd + 2));
            continue;
        }
#endif
        for (int64_t t = t0; t < t1; t++) {
            const float *vt = cache_row(a->vc, a->half, first + t, hd, buf);
            for (int64_t i = 0; i < group; i++) {
                float *o = a->part + ((g * group + i) * blocks + b) * (hd + 2) + 2;
                const float p = s[i][t];
                for (int64_t d = 0; d < hd; d++) o[d] += p * vt[d];
            }
        }
    }
    return 0;
}

/* out [heads, hd]: each head's blocks merged in order: softmax over all positions. */
static void attention_merge(const float *part, int64_t heads, int64_t blocks, int64_t hd,
                            float *out) {
    for (int64_t h = 0; h < heads; h++) {
        const float *ph = part + h * blocks * (hd + 2);
        float mx = ph[0];
        for (int64_t b = 1; b < blocks; b++) mx = ph[b * (hd + 2)] > mx ? ph[b * (hd + 2)] : mx;
        float *o = out + h * hd, sum = 0.0f;
        for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const float *pb = ph + b * (hd + 2);
            const float w = exp_nonpositive(pb[0] - mx);
            sum += w * pb[1];
            for (int64_t d = 0; d < hd; d++) o[d] += w * pb[2 + d];
        }
        for (int64_t d = 0; d < hd; d++) o[d] /= sum;
    }
}

#define MAX_TOP_K 64

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* The router's choice for x: the top k experts (ids, in order of score; ties to the lower expert)
 * and their weights w; probs and scores: scratch of `experts` floats each. */
static int route(const dq_decode_layer *L, const float *x, float *probs, float *scores,
                 int64_t *ids, float *w) {
    const int64_t n = L->router->rows, k = L->top_k;
    const int rc = product(L->router, x, probs);
    const int sigmoid = L->router_kind == DQ_ROUTER_SIGMOID;
    const float *bias = L->expert_bias;
    if (sigmoid) {
        for (int64_t e = 0; e < n; e++) {
            probs[e] = 1.0f / (1.0f + expf(-probs[e]));
            scores[e] = bias ? probs[e] + bias[e] : probs[e];
        }
    } else {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < n; e++) mx = probs[e] > mx ? probs[e] : mx;
        for (int64_t e = 0; e < n; e++) sum += (probs[e] = expf(probs[e] - mx));
        for (int64_t e = 0; e < n; e++) scores[e] = probs[e] /= sum;
    }
    float wsum = 0.0f;
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t t = 0; t < s; t++) taken |= ids[t] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[s] = best;
        wsum += (w[s] = probs[best]);
    }
    if (L->renormalize)
        for (int64_t s = 0; s < k; s++) w[s] /= sigmoid ? wsum + 1e-6f : wsum;
    if (sigmoid)
        for (int64_t s = 0; s < k; s++) w[s] *= L->routed_scaling;
    return rc;
}

/* Floats of scratch routed_experts needs for layer L. */
static int64_t routed_scratch(const dq_decode_layer *L, int64_t hidden) {
    const int64_t n = L->router->rows, k = L->top_k, inter = L->expert_intermediate;
    if (L->mlp_kind == DQ_MLP_EXPERTS) return 2 * n + k * (2 * hidden + 3 * inter);
    const int64_t p1 = L->expert_gate->padded_n, p3 = L->expert_down->padded_n;
    const int64_t shared = L->gate->rows;
    return 2 * n + k * (hidden + 2 * p1 + inter + p3) + 2 * shared + hidden;
}

/* The MLP of a routed-experts layer for x [hidden] into out [hidden] (scratch: routed_scratch).
 * DQ_MLP_EXPERTS: F.linear banks (expert_gate: gate and up concatenated; expert_down), the
 * weighted sum of the routed experts. DQ_MLP_HYBRID_EXPERTS (the reference hybrid): x @ W[e]
 * banks (outputs padded to their banks' padded widths), plus a shared SiLU-gated expert (gate,
 * up, down): out = shared + the routed experts' weighted sum. */
static int routed_experts(const dq_decode_layer *L, const float *x, int64_t hidden, float *out,
                          float *scratch) {
    const int64_t n = L->router->rows, k = L->top_k, inter = L->expert_intermediate;
    if (k < 1 || k > MAX_TOP_K || k > n) return -1;
    float *probs = scratch, *scores = probs + n, *xs = scores + n;
    int64_t ids[MAX_TOP_K];
    float w[MAX_TOP_K];
    int rc = route(L, x, probs, scores, ids, w);
    for (int64_t s = 0; s < k; s++) memcpy(xs + s * hidden, x, (size_t)hidden * sizeof(float));
    float *down, *shared = NULL;
    int64_t stride = hidden;
    if (L->mlp_kind == DQ_MLP_EXPERTS) {
        float *up = xs + k * hidden, *h = up + k * 2 * inter;
        down = h + k * inter;
        rc |= dq_experts_one(L->expert_gate, ids, k, xs, up);
        for (int64_t s = 0; s < k; s++)
            for (int64_t i = 0; i < inter; i++)
                h[s * inter + i] = silu(up[s * 2 * inter + i]) * up[s * 2 * inter + inter + i];
        rc |= dq_experts_one(L->expert_down, ids, k, h, down);
    } else {
        const int64_t p1 = L->expert_gate->padded_n, sn = L->gate->rows;
        float *g = xs + k * hidden, *u = g + k * p1, *h = u + k * p1;
        down = h + k * inter;
        stride = L->expert_down->padded_n;
        float *sg = down + k * stride, *su = sg + sn;
        shared = su + sn;
        rc |= dq_experts_one(L->expert_gate, ids, k, xs, g);
        rc |= dq_experts_one(L->expert_up, ids, k, xs, u);
        for (int64_t s = 0; s < k; s++)
            for (int64_t i = 0; i < inter; i++)
                h[s * inter + i] = silu(g[s * p1 + i]) * u[s * p1 + i];
        rc |= dq_experts_one(L->expert_down, ids, k, h, down);
        rc |= product(L->gate, x, sg);
        rc |= product(L->up, x, su);
        for (int64_t i = 0; i < sn; i++) sg[i] = silu(sg[i]) * su[i];
        rc |= product(L->down, sg, shared);
    }
    for (int64_t i = 0; i < hidden; i++) {
        float acc = 0.0f;
        for (int64_t s = 0; s < k; s++) acc += down[s * stride + i] * w[s];
        out[i] = shared ? shared[i] + acc : acc;
    }
    return rc;
}

/* A short-convolution layer's mixer for x [hidden] into out [hidden]; bcx: 3 * hidden floats. */
static int short_conv(const dq_decode_layer *L, const float *x, int64_t hidden, float *bcx,
                      float *out) {
    int rc = product(L->in_proj, x, bcx);
    const float *b = bcx, *c = bcx + hidden, *xx = bcx + 2 * hidden;
    const float *w = L->conv_weight, *bias = L->conv_bias;
    const int64_t k = L->conv_kernel;
    float *state = L->conv_state, *y = bcx; /* B's third is read before it is written */
    for (int64_t i = 0; i < hidden; i++) {
        float *si = state + i * k;
        memmove(si, si + 1, (size_t)(k - 1) * sizeof(float));
        si[k - 1] = b[i] * xx[i];
        float acc = 0.0f;
        for (int64_t j = 0; j < k; j++) acc += w[i * k + j] * si[j];
        if (bias) acc += bias[i];
        y[i] = c[i] * acc;
    }
    rc |= product(L->out_proj, y, out);
    return rc;
}

/* h [hidden]: the token's embedding in, the final hidden state's logits out in logits [rows of
 * the head]. pos: the token's position (the cache holds 0..pos-1; its keys and values go to pos).
 * 0, -1 if out of memory or a product failed, -2 if pos is past the cache's capacity. */
int dq_decode_step(const dq_decode_program *P, float *h, int64_t pos, float *logits) {
    const int64_t nl = P->layer_count, hidden = P->hidden, heads = P->heads, kvh = P->kv_heads;
    const int64_t hd = P->head_dim, inter = P->intermediate, capacity = P->capacity;
    if (pos < 0 || pos >= capacity) return -2;
    const float eps = P->rms_eps;
    const int64_t qn = heads * hd, kvn = kvh * hd;
    int64_t moe = 0; /* the largest routed-experts scratch of any layer */
    for (int64_t l = 0; l < nl; l++) {
        const dq_decode_layer *L = P->layers + l;
        if (L->mlp_kind != DQ_MLP_DENSE) {
            const int64_t need = routed_scratch(L, hidden);
            moe = need > moe ? need : moe;
        }
    }
    const int64_t gu = inter > hidden ? inter : hidden; /* g: also the experts' sum */
    const int64_t blocks = (pos + ATTENTION_BLOCK) / ATTENTION_BLOCK; /* of pos + 1 positions */
    if (heads / kvh > MAX_GROUP || hd > MAX_HEAD_DIM) return -1;
    const int half = P->cache_half; /* the cache's keys and values in float16 */
    const size_t floats = (size_t)(hidden + qn + 2 * kvn + qn + 2 * gu + hd + heads * (pos + 1) +
                                   heads * blocks * (hd + 2) + moe + 3 * hidden);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    float *x = buf, *q = x + hidden, *k = q + qn, *v = k + kvn, *att = v + kvn;
    float *g = att + qn, *u = g + gu, *cs = u + gu, *sn = cs + hd / 2;
    float *scores = cs + hd, *part = scores + heads * (pos + 1);
    float *experts = part + heads * blocks * (hd + 2), *bcx = experts + moe;
    for (int64_t i = 0; i < hd / 2; i++) {
        const float f = (float)pos * P->inv_freq[i];
        cs[i] = cosf(f) * P->rope_scaling;
        sn[i] = sinf(f) * P->rope_scaling;
    }
    int rc = 0;
    dq_pool_hold(1); /* the products follow each other closely */
    for (int64_t l = 0; l < nl && !rc; l++) {
        const dq_decode_layer *L = P->layers + l;
        rms_norm(h, L->norm, hidden, eps, x);
        if (L->kind == DQ_LAYER_CONVOLUTION) {
            rc |= short_conv(L, x, hidden, bcx, x);
        } else {
            rc |= product(L->q, x, q);
            rc |= product(L->k, x, k);
            rc |= product(L->v, x, v);
            if (L->q_norm && L->qk_norm_all_heads) { /* over all heads at once (OLMoE) */
                rms_norm(q, L->q_norm, qn, eps, q);
                rms_norm(k, L->k_norm, kvn, eps, k);
            } else if (L->q_norm) {
                for (int64_t i = 0; i < heads; i++)
                    rms_norm(q + i * hd, L->q_norm, hd, eps, q + i * hd);
                for (int64_t i = 0; i < kvh; i++)
                    rms_norm(k + i * hd, L->k_norm, hd, eps, k + i * hd);
            }
            rotary(q, heads, hd, cs, sn);
            rotary(k, kvh, hd, cs, sn);
            void *kc = L->keys, *vc = L->values;
            for (int64_t j = 0; j < kvh; j++) { /* each key/value head's row of positions */
                cache_store(kc, half, j * capacity + pos, hd, k + j * hd);
                cache_store(vc, half, j * capacity + pos, hd, v + j * hd);
            }
            const attention_job aj = {q, kc, vc, pos + 1, capacity, heads, kvh, hd,
                                      P->attention_scale, scores, part, half};
            const int64_t macs = 2 * heads * (pos + 1) * hd;
            dq_parallel(attend_blocks, &aj, kvh * blocks,
                        macs >= P->attention_min_macs ? P->attention_threads : 1);
            attention_merge(part, heads, blocks, hd, att);
            rc |= product(L->o, att, x);
        }
        for (int64_t i = 0; i < hidden; i++) h[i] += x[i]; /* the mixer's residual */
        rms_norm(h, L->mlp_norm, hidden, eps, x);
        if (L->mlp_kind != DQ_MLP_DENSE) {
            rc |= routed_experts(L, x, hidden, g, experts);
            for (int64_t i = 0; i < hidden; i++) h[i] += g[i];
            continue;
        }
        rc |= product(L->gate, x, g);
        rc |= product(L->up, x, u);
        for (int64_t i = 0; i < inter; i++) g[i] = silu(g[i]) * u[i];
        rc |= product(L->down, g, x);
        for (int64_t i = 0; i < hidden; i++) h[i] += x[i];
    }
    if (!rc) {
        rms_norm(h, P->final_norm, hidden, eps, x);
        rc = product(P->head, x, logits);
    }
    dq_pool_hold(0);
    free(buf);
    return rc ? -1 : 0;
}
