/* dynquant's native interface: every kernel the library exports and the descriptor structs that
 * the one-token products and the decode step read. Python mirrors these structs once, as
 * ctypes.Structures (native/interface.py), beside one table of the functions' signatures;
 * tests/numerics/test_native_interface.py holds both to this file: every struct's size and every field's
 * offset (asked of the compiled library through dq_layout), every function's arguments.
 *
 * Layout rules, so that ctypes lays a struct out as C does on every 64-bit target: pointers and
 * int64_t first, then int32_t and float in pairs (no implicit padding anywhere); each struct's
 * size and offsets are pinned below by _Static_assert. Pointers to tensor memory are addresses
 * the caller keeps alive; a NULL optional pointer means "none".
 *
 * Packed weights (docs/format.md): qweight [rows, padded_n * bits / 32] uint32 words, scales and
 * offsets [rows, padded_n / gs] bf16 bits; w = code * scale + offset. */
#ifndef DQ_KERNELS_H
#define DQ_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* ---- descriptors ---- */

/* A block of packed rows prepared once for one-token products (dq_matvec_one, _q8_one,
 * _q16_one): x holds in_features values, copied beside zeros to padded_n where the layout pads. */
typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t rows, padded_n, gs, in_features;
    int32_t bits, threads;
} dq_packed_block;

/* How a bank's (token, expert) pairs multiply (dq_expert_pairs.kind). */
enum {
    DQ_PAIRS_MATVEC = 0,     /* F.linear(x[p], W[e_p]), float32 activations */
    DQ_PAIRS_VECMAT = 1,     /* x[p] @ W[e_p], y [pairs, padded_n] */
    DQ_PAIRS_MATVEC_Q8 = 2,  /* F.linear with int8 activations */
    DQ_PAIRS_MATVEC_Q16 = 3, /* F.linear with int16 activations */
};

/* An expert bank ([experts * rows_per_expert, padded_n] packed rows, expert e's rows contiguous)
 * prepared once for dq_experts_one; its pairs split over `threads` from min_work multiply-adds. */
typedef struct {
    const uint32_t *qweight;
    const uint16_t *scales, *offsets;
    int64_t rows_per_expert, padded_n, gs, in_features, experts, min_work;
    int32_t bits, kind, threads, reserved;
} dq_expert_pairs;

/* What a product descriptor multiplies (dq_product.kind). */
enum {
    DQ_PRODUCT_PACKED = 0,     /* weight: a dq_packed_block, float32 activations */
    DQ_PRODUCT_PACKED_Q8 = 1,  /* weight: a dq_packed_block, int8 activations */
    DQ_PRODUCT_DENSE_F32 = 2,  /* weight: float32 [rows, cols] */
    DQ_PRODUCT_DENSE_BF16 = 3, /* weight: bf16 [rows, cols] (dense_matvec.c, `threads`) */
    DQ_PRODUCT_PACKED_Q16 = 4, /* weight: a dq_packed_block, int16 activations */
};

/* One of the decode step's products, y [rows] = W x [cols] (+ bias). */
typedef struct {
    const void *weight;
    const float *bias; /* float32 [rows] or NULL */
    int64_t rows, cols;
    int32_t kind, threads;
} dq_product;

enum { DQ_LAYER_ATTENTION = 0, DQ_LAYER_CONVOLUTION = 1 };
enum {
    DQ_MLP_DENSE = 0,         /* gate, up, down */
    DQ_MLP_EXPERTS = 1,       /* F.linear banks: expert_gate holds gate and up concatenated */
    DQ_MLP_HYBRID_EXPERTS = 2 /* x @ W[e] banks (expert_gate, expert_up, expert_down) and a shared
                                 expert in gate, up, down */
};
enum { DQ_ROUTER_SOFTMAX = 0, DQ_ROUTER_SIGMOID = 1 };

/* One decoder layer: a mixer (attention or a short convolution) and an MLP, each after its
 * RMSNorm (float32 weights). */
typedef struct {
    const float *norm, *mlp_norm;
    /* attention: q_norm, k_norm per head, or over all heads where qk_norm_all_heads (OLMoE);
     * keys, values [kv_heads, capacity, head_dim] in the program's cache type */
    const dq_product *q, *k, *v, *o;
    const float *q_norm, *k_norm;
    void *keys, *values;
    /* short convolution (LFM2): in_proj (3 * hidden rows: B, C, x), conv_weight float32
     * [hidden, conv_kernel], conv_bias [hidden] or NULL, state [hidden, conv_kernel] oldest first */
    const dq_product *in_proj, *out_proj;
    const float *conv_weight, *conv_bias;
    float *conv_state;
    int64_t conv_kernel;
    /* MLP: the dense products, or the shared expert of DQ_MLP_HYBRID_EXPERTS */
    const dq_product *gate, *up, *down;
    /* routed experts: the router's logits, the banks, the top k (renormalised where asked),
     * an expert's intermediate size; a sigmoid router's expert bias (or NULL) and scaling */
    const dq_product *router;
    const dq_expert_pairs *expert_gate, *expert_up, *expert_down;
    const float *expert_bias;
    int64_t top_k, expert_intermediate;
    int32_t kind, mlp_kind, router_kind, renormalize, qk_norm_all_heads;
    float routed_scaling;
} dq_decode_layer;

/* A model's decode program: its layers, the final norm and head, rotary frequencies (float32
 * [head_dim / 2]) and the cache's capacity and element type (cache_half: float16, else float32);
 * the attention splits over attention_threads from attention_min_macs multiply-adds. */
typedef struct {
    const dq_decode_layer *layers;
    const float *final_norm, *inv_freq;
    const dq_product *head;
    int64_t layer_count, hidden, heads, kv_heads, head_dim, intermediate, capacity;
    int64_t attention_min_macs;
    int32_t attention_threads, cache_half;
    float rms_eps, rope_scaling, attention_scale, reserved;
} dq_decode_program;

/* ---- the pinned layouts: X(struct, field, offset) for every field, and each struct's size ---- */
#define DQ_PACKED_BLOCK_FIELDS(X)                                                              \
    X(dq_packed_block, qweight, 0) X(dq_packed_block, scales, 8)                               \
    X(dq_packed_block, offsets, 16) X(dq_packed_block, rows, 24)                               \
    X(dq_packed_block, padded_n, 32) X(dq_packed_block, gs, 40)                                \
    X(dq_packed_block, in_features, 48) X(dq_packed_block, bits, 56)                           \
    X(dq_packed_block, threads, 60)
#define DQ_EXPERT_PAIRS_FIELDS(X)                                                              \
    X(dq_expert_pairs, qweight, 0) X(dq_expert_pairs, scales, 8)                               \
    X(dq_expert_pairs, offsets, 16) X(dq_expert_pairs, rows_per_expert, 24)                    \
    X(dq_expert_pairs, padded_n, 32) X(dq_expert_pairs, gs, 40)                                \
    X(dq_expert_pairs, in_features, 48) X(dq_expert_pairs, experts, 56)                        \
    X(dq_expert_pairs, min_work, 64) X(dq_expert_pairs, bits, 72) X(dq_expert_pairs, kind, 76) \
    X(dq_expert_pairs, threads, 80) X(dq_expert_pairs, reserved, 84)
#define DQ_PRODUCT_FIELDS(X)                                                                   \
    X(dq_product, weight, 0) X(dq_product, bias, 8) X(dq_product, rows, 16)                    \
    X(dq_product, cols, 24) X(dq_product, kind, 32) X(dq_product, threads, 36)
#define DQ_DECODE_LAYER_FIELDS(X)                                                              \
    X(dq_decode_layer, norm, 0) X(dq_decode_layer, mlp_norm, 8) X(dq_decode_layer, q, 16)      \
    X(dq_decode_layer, k, 24) X(dq_decode_layer, v, 32) X(dq_decode_layer, o, 40)              \
    X(dq_decode_layer, q_norm, 48) X(dq_decode_layer, k_norm, 56)                              \
    X(dq_decode_layer, keys, 64) X(dq_decode_layer, values, 72)                                \
    X(dq_decode_layer, in_proj, 80) X(dq_decode_layer, out_proj, 88)                           \
    X(dq_decode_layer, conv_weight, 96) X(dq_decode_layer, conv_bias, 104)                     \
    X(dq_decode_layer, conv_state, 112) X(dq_decode_layer, conv_kernel, 120)                   \
    X(dq_decode_layer, gate, 128) X(dq_decode_layer, up, 136) X(dq_decode_layer, down, 144)    \
    X(dq_decode_layer, router, 152) X(dq_decode_layer, expert_gate, 160)                       \
    X(dq_decode_layer, expert_up, 168) X(dq_decode_layer, expert_down, 176)                    \
    X(dq_decode_layer, expert_bias, 184) X(dq_decode_layer, top_k, 192)                        \
    X(dq_decode_layer, expert_intermediate, 200) X(dq_decode_layer, kind, 208)                 \
    X(dq_decode_layer, mlp_kind, 212) X(dq_decode_layer, router_kind, 216)                     \
    X(dq_decode_layer, renormalize, 220) X(dq_decode_layer, qk_norm_all_heads, 224)            \
    X(dq_decode_layer, routed_scaling, 228)
#define DQ_DECODE_PROGRAM_FIELDS(X)                                                            \
    X(dq_decode_program, layers, 0) X(dq_decode_program, final_norm, 8)                        \
    X(dq_decode_program, inv_freq, 16) X(dq_decode_program, head, 24)                          \
    X(dq_decode_program, layer_count, 32) X(dq_decode_program, hidden, 40)                     \
    X(dq_decode_program, heads, 48) X(dq_decode_program, kv_heads, 56)                         \
    X(dq_decode_program, head_dim, 64) X(dq_decode_program, intermediate, 72)                  \
    X(dq_decode_program, capacity, 80) X(dq_decode_program, attention_min_macs, 88)            \
    X(dq_decode_program, attention_threads, 96) X(dq_decode_program, cache_half, 100)          \
    X(dq_decode_program, rms_eps, 104) X(dq_decode_program, rope_scaling, 108)                 \
    X(dq_decode_program, attention_scale, 112) X(dq_decode_program, reserved, 116)
/* struct, size */
#define DQ_DESCRIPTORS(X)                                                                      \
    X(dq_packed_block, 64) X(dq_expert_pairs, 88) X(dq_product, 40) X(dq_decode_layer, 232)    \
    X(dq_decode_program, 120)

#define DQ_ASSERT_OFFSET(S, f, off) _Static_assert(offsetof(S, f) == off, #S "." #f " at " #off);
#define DQ_ASSERT_SIZE(S, size) _Static_assert(sizeof(S) == size, "sizeof " #S " is " #size);
DQ_PACKED_BLOCK_FIELDS(DQ_ASSERT_OFFSET)
DQ_EXPERT_PAIRS_FIELDS(DQ_ASSERT_OFFSET)
DQ_PRODUCT_FIELDS(DQ_ASSERT_OFFSET)
DQ_DECODE_LAYER_FIELDS(DQ_ASSERT_OFFSET)
DQ_DECODE_PROGRAM_FIELDS(DQ_ASSERT_OFFSET)
DQ_DESCRIPTORS(DQ_ASSERT_SIZE)

/* sizeof(struct `type`) where `field` is NULL or "", else offsetof(type, field); -1 for a name
 * the library does not know (layout.c). */
int64_t dq_layout(const char *type, const char *field);
/* How many fields `type` has (-1: unknown type). */
int64_t dq_layout_fields(const char *type);

/* ---- kernels ----
 * Products return 0, or -1 if out of memory or the group size / width is unsupported; `*_mt`
 * variants split their work over `threads` threads (pool.c); `portable` != 0 forces the portable
 * unpacking (to hold the SIMD paths to it). x is float32 [m, padded_n] with zeros in the padding
 * unless said otherwise. */

/* quantize_rows.c: the clip search, codes and packing of float32 or bf16 rows. */
int dq_quantize_rows(const void *w, int is_bf16, int64_t rows, int64_t n, int64_t gs, int bits,
                     const float *alphas, int n_alphas, const float *importance,
                     uint32_t *qweight, uint16_t *scales, uint16_t *offsets, uint8_t *chosen,
                     float *chosen_err, float *first_err);

/* dequantize_rows.c, dequantize_int4pack.c: rows to float32 or bf16 (out_bf16). */
int dq_dequantize_rows(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                       int64_t rows, int64_t n, int64_t gs, int bits, void *out, int out_bf16,
                       int portable);
int dq_dequantize_rows_mt(const uint32_t *qweight, const uint16_t *scales,
                          const uint16_t *offsets, int64_t rows, int64_t n, int64_t gs, int bits,
                          void *out, int out_bf16, int portable, int threads);
int dq_dequantize_int4pack(const uint8_t *packed, const uint16_t *scale_zero,
                           const uint16_t *offsets, int64_t n, int64_t k, int64_t gs, int64_t B,
                           int64_t start, int64_t stop, void *out, int out_bf16);
int dq_dequantize_int4pack_mt(const uint8_t *packed, const uint16_t *scale_zero,
                              const uint16_t *offsets, int64_t n, int64_t k, int64_t gs,
                              int64_t B, int64_t start, int64_t stop, void *out, int out_bf16,
                              int threads);

/* packed_matvec.c, packed_matvec_tokens.c: y [m, rows] (row stride y_stride) = x @ W^T. */
int dq_matvec_has_simd(void); /* 2: AVX-512 VBMI unpacking, 1: AVX2, 0: portable */
int dq_matvec(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              float *y, int64_t y_stride, int portable);
int dq_matvec_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int64_t y_stride, int portable, int threads);
/* 2-8 tokens; -2: no few-token path for this build or group size (use dq_matvec_mt). */
int dq_matvec_tokens_mt(const uint32_t *qweight, const uint16_t *scales,
                        const uint16_t *offsets, int64_t rows, int64_t padded_n, int64_t gs,
                        int bits, const float *x, int64_t m, float *y, int64_t y_stride,
                        int threads);
/* One token, x [in_features], y [rows]. */
int dq_matvec_one(const dq_packed_block *block, const float *x, float *y);

/* packed_matvec_q8.c, packed_matvec_q16.c: the same product with int8 / int16 activations. */
int dq_q8_simd(void); /* 2: VNNI dot products, 1: AVX2, 0: portable */
void dq_q8_quantize(const float *x, int64_t padded_n, int8_t *xq, float *d);
int dq_q8_group_dots(const uint32_t *qweight, int64_t rows, int64_t padded_n, int64_t gs,
                     int bits, const int8_t *xq, int32_t *dots, int portable);
int dq_matvec_q8_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                    int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                    int64_t m, float *y, int64_t y_stride, int portable, int threads);
int dq_matvec_q8_one(const dq_packed_block *block, const float *x, float *y);
void dq_q16_quantize(const float *x, int64_t n, int64_t gs, int16_t *xq, float *d);
int dq_q16_group_dots(const uint32_t *qweight, int64_t rows, int64_t padded_n, int64_t gs,
                      int bits, const int16_t *xq, int32_t *dots, int portable);
int dq_matvec_q16_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                     int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x,
                     int64_t m, float *y, int64_t y_stride, int portable, int threads);
int dq_matvec_q16_one(const dq_packed_block *block, const float *x, float *y);

/* packed_vecmat.c: y [m, padded_n] = x [m, rows] @ W, output groups [g0, g1) (dq_vecmat). */
int dq_vecmat(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable);
int dq_vecmat_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int portable, int threads);

/* packed_gemm.c: many tokens (prefill); dq_gemm_t: x @ W with groups along the output. */
int dq_gemm_tile(void); /* the register tile: MR * 10000 + NRV * 100 + vector width */
int dq_gemm(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
            int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t n,
            int64_t m, float *y, int64_t y_stride, int portable);
int dq_gemm_t(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
              int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
              int64_t g0, int64_t g1, float *y, int portable);
int dq_gemm_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
               int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t n,
               int64_t m, float *y, int64_t y_stride, int portable, int threads);
int dq_gemm_t_mt(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                 int64_t rows, int64_t padded_n, int64_t gs, int bits, const float *x, int64_t m,
                 float *y, int portable, int threads);

/* packed_experts.c, packed_matvec_experts.c: (token, expert) pairs of a bank; pair p multiplies
 * x[p] with expert experts[p] (rows [r0, r1) or output groups [g0, g1) of each expert). */
int dq_matvec_experts(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                      int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                      const int64_t *experts, int64_t pairs, const float *x, float *y,
                      int64_t r0, int64_t r1, int portable);
int dq_vecmat_experts(const uint32_t *qweight, const uint16_t *scales, const uint16_t *offsets,
                      int64_t rows_per_expert, int64_t padded_n, int64_t gs, int bits,
                      const int64_t *experts, int64_t pairs, const float *x, float *y,
                      int64_t g0, int64_t g1, int portable);
int dq_matvec_experts_mt(const uint32_t *qweight, const uint16_t *scales,
                         const uint16_t *offsets, int64_t rows_per_expert, int64_t padded_n,
                         int64_t gs, int bits, const int64_t *experts, int64_t pairs,
                         const float *x, float *y, int portable, int threads);
int dq_vecmat_experts_mt(const uint32_t *qweight, const uint16_t *scales,
                         const uint16_t *offsets, int64_t rows_per_expert, int64_t padded_n,
                         int64_t gs, int bits, const int64_t *experts, int64_t pairs,
                         const float *x, float *y, int portable, int threads);
/* int8 (wide = 0) or int16 (wide = 1) activations. */
int dq_matvec_integer_experts_mt(int wide, const uint32_t *qweight, const uint16_t *scales,
                                 const uint16_t *offsets, int64_t rows_per_expert,
                                 int64_t padded_n, int64_t gs, int bits, const int64_t *experts,
                                 int64_t pairs, const float *x, float *y, int threads);
/* A prepared bank's pairs; x holds in_features values a pair (kinds other than VECMAT). -2: an
 * expert index outside the bank, nothing computed. */
int dq_experts_one(const dq_expert_pairs *bank, const int64_t *experts, int64_t pairs,
                   const float *x, float *y);

/* dense_matvec.c: a dense bf16 matrix [rows, cols] times m float32 tokens. */
int dq_dense_matvec_bf16_mt(const uint16_t *w, int64_t rows, int64_t cols, const float *x,
                            int64_t m, float *y, int64_t y_stride, int threads);

/* decode_step.c: one token through every layer, the final norm and the head. h [hidden]: the
 * token's embedding (overwritten); logits [head rows]; pos: the token's position. 0, -1 if out
 * of memory or a product failed, -2 if pos is past the cache's capacity. */
int dq_decode_step(const dq_decode_program *program, float *h, int64_t pos, float *logits);

/* tuned_rounding.c: Adam's step (clipped to lr) on the tunable roundings of a chunk of codes:
 * bit p of mask (words uint64, low bit first) set where weight p (of grad and codes) has one,
 * their state (u, m, s2, q0) in the order of p; first[s] the count of them before segment s
 * (DQ_ROUNDING_SEGMENT weights a segment). k: b1, 1 - b1, b2, 1 - b2, sqrt(1 - b2^t), eps,
 * 1 / (1 - b1^t), lr. grad float32, or bf16 where grad_bf16. Codes that change are written, on
 * `threads` threads. Returns how many changed. */
#define DQ_ROUNDING_SEGMENT 4096
int64_t dq_rounding_step(const void *grad, int grad_bf16, const uint64_t *mask,
                         const int64_t *first, int64_t words, float *u, uint16_t *m,
                         uint16_t *s2, const uint8_t *q0, uint8_t *codes, const float *k,
                         int max_code, int threads);

/* tunable_dequantize.c: codes q (uint8 [rows, groups, gs]) with float32 scales s and offsets o
 * [rows, groups]: forward w = q * s + o (float32 [rows, groups * gs], stored past the caches
 * where w is aligned; _bf16: each rounded to nearest bf16, ties to even); backward
 * the group sums of grad * q and of grad (its fixed order there; grad float32, or bf16 where
 * grad_bf16). gs a multiple of 16, else -1. */
int dq_tunable_forward(const uint8_t *q, const float *s, const float *o, int64_t rows,
                       int64_t groups, int64_t gs, float *w, int threads);
int dq_tunable_forward_bf16(const uint8_t *q, const float *s, const float *o, int64_t rows,
                            int64_t groups, int64_t gs, uint16_t *w, int threads);
int dq_tunable_backward(const void *grad, int grad_bf16, const uint8_t *q, int64_t rows,
                        int64_t groups, int64_t gs, float *grad_s, float *grad_o, int threads);
/* The same backward from the packed codes (the format's: qweight [rows, groups * bits * gs / 32]
 * words), each group unpacked where it is summed: the same sums, bit for bit. gs a multiple of
 * 32 up to 1024, else -1. */
int dq_tunable_backward_packed(const float *grad, const uint32_t *qweight, int64_t rows,
                               int64_t groups, int64_t gs, int bits, float *grad_s,
                               float *grad_o, int threads);

/* gptq_columns.c: GPTQ's sweep over columns [k0, k1) of the act-ordered transpose w
 * [columns][rows] (each rounded with its group's scales, offsets and divisors [groups][rows],
 * group column[k] / group_size; codes written to row column[k] of codes [in][rows]; errors
 * [k - start][rows] = (w - rounded) / u[k][k], taken off columns k + 1 .. sub_end - 1 through
 * u [columns][columns]); residual (NULL: none): each weight's rounding residual in codes,
 * float16 bits [columns][rows]; on `threads` threads. 0, or -1 for a bad range. */
int dq_gptq_columns(float *w, const float *u, int64_t rows, int64_t columns, int64_t k0,
                    int64_t k1, int64_t sub_end, int64_t start, const int64_t *column,
                    int64_t group_size, const float *scales, const float *offsets,
                    const float *divisors, uint8_t *codes, uint16_t *residual,
                    float *errors, int max_code, int threads);

/* pool.c: 1 while calls follow each other closely (the workers' waits spin longer), then 0. */
void dq_pool_hold(int on);
#endif
