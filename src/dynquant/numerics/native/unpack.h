/* Shared by the kernels: bf16 conversions, the fixed summation tree (the format's order for the
 * clip search's errors), and the unpacking of a group's codes (portable; with AVX-512 VBMI where
 * the CPU has it, else AVX2).
 * Codes: code j of a group occupies stream bits [j*bits, (j+1)*bits), LSB first in little-endian
 * 32-bit words (format/packing.py); 8 codes fill exactly `bits` bytes. */
#ifndef DQ_UNPACK_H
#define DQ_UNPACK_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define DQ_HAVE_VBMI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define DQ_HAVE_AVX2 1
#endif

#define LANES 16
#define MAX_GROUP 1024

/* x within [lo, hi]: two selects, which vectorize where a nested one does not. */
static inline float clamp(float x, float lo, float hi) {
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float -> bfloat16 bits, nearest, ties to even (as torch converts); NaN stays a (quiet) NaN.
 * Without a branch, so that a loop calling it vectorizes (tuned_rounding.c). */
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = 0u - (uint32_t)((u & 0x7FFFFFFFu) > 0x7F800000u); /* all ones or 0 */
    return (uint16_t)((((u >> 16) | 0x40u) & nan) | (rounded & ~nan));
}

/* Software prefetch of the packed codes ahead of their use. Decode streams every weight from
 * memory once per token, and the hardware prefetcher alone keeps a narrow-code product at about
 * half its in-cache rate; 4 KiB ahead brings it near that rate at every width (2 KiB still
 * left 8-bit codes, which are read fastest, waiting on memory): benchmarks/memory_bandwidth.py.
 * A prefetch never faults, so running past the end is harmless. */
#define DQ_PREFETCH_BYTES 4096
static inline void prefetch_codes_at(const uint8_t *bytes, int64_t ahead) {
    __builtin_prefetch(bytes + ahead, 0, 3);
    __builtin_prefetch(bytes + ahead + 64, 0, 3);
}
static inline void prefetch_codes(const uint8_t *bytes) {
    prefetch_codes_at(bytes, DQ_PREFETCH_BYTES);
}

/* ``rows`` inputs of ``n`` values copied beside zeros to ``padded_n`` each (stride padded_n), for
 * a layout that pads its groups; the caller frees it. NULL if out of memory. */
static inline float *padded_rows(const float *x, int64_t rows, int64_t n, int64_t padded_n) {
    float *out = calloc((size_t)(rows * padded_n), sizeof(float));
    if (out)
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + r * padded_n, x + r * n, (size_t)n * sizeof(float));
    return out;
}

/* The products' multi-threaded entry points share one signature (dq_matvec_mt's). */
typedef int (*dq_matvec_mt_fn)(const uint32_t *qweight, const uint16_t *scales,
                               const uint16_t *offsets, int64_t rows, int64_t padded_n,
                               int64_t gs, int bits, const float *x, int64_t m, float *y,
                               int64_t y_stride, int portable, int threads);

/* One token through `kernel` with a block's fixed arguments prepared once by the caller (decode
 * calls this once per Linear per step: 13 converted arguments cost more than a 256 x 256
 * product). x holds in_features values; where the layout pads them (SmolLM2's 576 inputs: 640)
 * they are copied beside zeros here, not by the caller. */
static inline int dq_one_token(dq_matvec_mt_fn kernel, const dq_packed_block *b, const float *x,
                               float *y) {
    float *padded = NULL;
    if (b->in_features < b->padded_n) {
        if (!(padded = padded_rows(x, 1, b->in_features, b->padded_n))) return -1;
        x = padded;
    }
    const int rc = kernel(b->qweight, b->scales, b->offsets, b->rows, b->padded_n, b->gs, b->bits,
                          x, 1, y, b->rows, 0, b->threads);
    free(padded);
    return rc;
}

static inline float lane_sum(const float *acc) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* xsum[t * groups + g]: the sum of token t's group g of x [m, padded_n], in 16 lanes combined as
 * lane_sum does (the offsets' part of the packed matvecs). Not inlined: inlined before the
 * one-token loop of packed_matvec.c it moves that loop's code and slows it (code placement;
 * benchmarks/packed_products.py). */
static __attribute__((noinline, unused)) void group_sums(const float *x, int64_t m,
                                                         int64_t groups, int64_t gs,
                                                         int64_t padded_n, float *xsum) {
    for (int64_t t = 0; t < m; t++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + t * padded_n + g * gs;
            float acc[LANES] = {0};
            for (int64_t j = 0; j < gs; j += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += xg[j + l];
            xsum[t * groups + g] = lane_sum(acc);
        }
}

/* 8 codes fill `bits` bytes. Unit k of a group, from its first byte: one 8-byte load where that
 * stays inside the group (the bytes past the unit are masked off by the callers), else byte by
 * byte (a narrower copy into a wider variable would stall on store-to-load forwarding). The AVX2
 * paths load units their own way (unit_floats_avx2). */
static inline uint64_t load_unit(const uint8_t *bytes, int64_t k, int bits, int64_t group_bytes) {
    uint64_t u = 0;
    if (k * bits + 8 <= group_bytes)
        memcpy(&u, bytes + k * bits, sizeof u);
    else
        for (int b = 0; b < bits; b++) u |= (uint64_t)bytes[k * bits + b] << (8 * b);
    return u;
}

/* Unpack unit by unit with constant shifts. */
static inline void unpack_units(const uint8_t *bytes, int64_t gs, int bits, float *q) {
    const uint64_t mask = (1u << bits) - 1;
    for (int64_t k = 0; k < gs / 8; k++) {
        const uint64_t u = load_unit(bytes, k, bits, gs * bits / 8);
        for (int i = 0; i < 8; i++) q[8 * k + i] = (float)((u >> (i * bits)) & mask);
    }
}

static void unpack_group(const uint8_t *bytes, int64_t gs, int bits, float *q) {
    switch (bits) {
    case 2: unpack_units(bytes, gs, 2, q); break;
    case 3: unpack_units(bytes, gs, 3, q); break;
    case 4: unpack_units(bytes, gs, 4, q); break;
    case 5: unpack_units(bytes, gs, 5, q); break;
    case 6: unpack_units(bytes, gs, 6, q); break;
    case 8: for (int64_t j = 0; j < gs; j++) q[j] = (float)bytes[j]; break;
    default: unpack_units(bytes, gs, bits, q);
    }
}

#ifdef DQ_HAVE_VBMI
typedef struct {
    __m512i perm, shifts, mask;
} unpacker;

static unpacker make_unpacker(int bits) {
    uint8_t perm[64], shifts[64];
    for (int k = 0; k < 8; k++)
        for (int b = 0; b < 8; b++) {
            perm[8 * k + b] = (uint8_t)(k * bits + (b < bits ? b : 0)); /* unit k -> qword k */
            shifts[8 * k + b] = (uint8_t)(b * bits);                    /* code b's first bit */
        }
    unpacker u = {_mm512_loadu_si512(perm), _mm512_loadu_si512(shifts),
                  _mm512_set1_epi8((char)((1 << bits) - 1))};
    return u;
}

/* `count` (32 or 64) codes at p -> bytes of a zmm (a masked load never reads past the codes). */
static inline __m512i unpack_codes64(const uint8_t *p, int bits, int count, const unpacker *u) {
    const __mmask64 load = (__mmask64)(count * bits == 512 ? ~0ULL : (1ULL << (count * bits / 8)) - 1);
    const __m512i units = _mm512_permutexvar_epi8(u->perm, _mm512_maskz_loadu_epi8(load, p));
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(u->shifts, units), u->mask);
}

/* The 16 codes of part p (0..3) of an unpacked zmm as floats; p a constant after inlining. */
#define DQ_PART(c, p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32((c), (p))))

/* The same for a part known only at run time (the instruction takes an immediate). */
static inline __m512 codes_as_floats(__m512i c, int part) {
    switch (part) {
    case 0: return DQ_PART(c, 0);
    case 1: return DQ_PART(c, 1);
    case 2: return DQ_PART(c, 2);
    default: return DQ_PART(c, 3);
    }
}

/* lane_sum of a zmm, in registers: the same tree, so the same float. */
static inline float lane_sum_zmm(__m512 acc) {
    const __m256 hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), hi8);         /* l + (l + 8) */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 t = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));       /* s4[0]+s4[2], s4[1]+s4[3] */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* A group's codes as floats, 64 (or, for gs = 32, 32) at a time. */
static inline void unpack_group_vbmi(const uint8_t *bytes, int64_t gs, int bits,
                                     const unpacker *u, float *q) {
    for (int64_t j = 0; j < gs; j += 64) {
        const int count = gs - j >= 64 ? 64 : 32;
        const __m512i c = unpack_codes64(bytes + j * bits / 8, bits, count, u);
        for (int part = 0; part < count / 16; part++)
            _mm512_storeu_ps(q + j + 16 * part, codes_as_floats(c, part));
    }
}
#endif /* DQ_HAVE_VBMI */

#ifdef DQ_HAVE_AVX2
/* The pshufb and vpsrlvd operands of unit_floats_avx2 for one width. */
typedef struct {
    __m256i shuffle, shifts, mask;
} avx2_unpacker;

static inline avx2_unpacker make_avx2_unpacker(int bits) {
    int8_t shuffle[32];
    int32_t shifts[8];
    for (int i = 0; i < 8; i++) { /* dword i <- bytes b, b + 1 of the unit (pshufb indexes within
                                      each 128-bit lane; every lane holds the unit's 8 bytes) */
        const int b = i * bits / 8;
        shifts[i] = i * bits % 8;
        shuffle[4 * i] = (int8_t)b;
        shuffle[4 * i + 1] = (int8_t)(b + 1);
        shuffle[4 * i + 2] = shuffle[4 * i + 3] = (int8_t)0x80;
    }
    avx2_unpacker u = {_mm256_loadu_si256((const __m256i *)shuffle),
                       _mm256_loadu_si256((const __m256i *)shifts),
                       _mm256_set1_epi32((1 << bits) - 1)};
    return u;
}

/* 8 codes -> 8 floats: code i's two bytes into dword i (pshufb with `shuffle`), shifted to its
 * first bit (vpsrlvd) and masked. v holds the unit's bytes in every qword. */
static inline __m256 unit_bytes_as_floats_avx2(__m256i v, __m256i shuffle, const avx2_unpacker *u) {
    const __m256i w = _mm256_srlv_epi32(_mm256_shuffle_epi8(v, shuffle), u->shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, u->mask));
}

/* 8 bytes at p in every qword of a ymm: one broadcast load, not a scalar load, vmovq and
 * vpbroadcastq (BENCHMARKS.md, "AVX2: how units are loaded"). */
static inline __m256i broadcast8_avx2(const uint8_t *p) {
    return _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p));
}

/* Unit k of a group (8 codes) as floats. Where 8 bytes from the unit would pass the group's end,
 * the group's last 8 bytes are loaded and the shuffle's byte indices moved up by the unit's place
 * in them (its 0x80 entries stay >= 0x80: still zero); bytes past the unit are masked off. */
static inline __m256 unit_floats_avx2(const uint8_t *bytes, int64_t k, int bits,
                                      int64_t group_bytes, const avx2_unpacker *u) {
    const int64_t start = k * bits;
    if (start + 8 <= group_bytes)
        return unit_bytes_as_floats_avx2(broadcast8_avx2(bytes + start), u->shuffle, u);
    const __m256i moved = _mm256_add_epi8(u->shuffle, _mm256_set1_epi8((char)(start + 8 - group_bytes)));
    return unit_bytes_as_floats_avx2(broadcast8_avx2(bytes + group_bytes - 8), moved, u);
}

/* Units k and k + 1 of a group (codes 8k .. 8k + 15) as floats: q0 the first 8, q1 the next. */
static inline __attribute__((always_inline)) void unit_pair_avx2(
    const uint8_t *bytes, int64_t k, int bits, int64_t group_bytes, const avx2_unpacker *u,
    __m256 *q0, __m256 *q1) {
    if (bits == 8) {
        *q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * k))));
        *q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * k + 8))));
    } else {
        *q0 = unit_floats_avx2(bytes, k, bits, group_bytes, u);
        *q1 = unit_floats_avx2(bytes, k + 1, bits, group_bytes, u);
    }
}

/* lane_sum of 16 lanes held as two ymm (lanes 0-7, 8-15): the same tree, so the same float. */
static inline float lane_sum_ymm2(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);                               /* l + (l + 8) */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 t = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));       /* s4[0]+s4[2], s4[1]+s4[3] */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* The units that lie 8 bytes inside the group first, without unit_floats_avx2's per-unit test
 * (a branch per unit in the hot loop), then the group's last ones. */
static inline void unpack_units_avx2(const uint8_t *bytes, int64_t gs, int bits, float *q) {
    const avx2_unpacker u = make_avx2_unpacker(bits);
    const int64_t group_bytes = gs * bits / 8, inside = (group_bytes - 8) / bits + 1;
    for (int64_t k = 0; k < inside; k++)
        _mm256_storeu_ps(q + 8 * k, unit_bytes_as_floats_avx2(broadcast8_avx2(bytes + k * bits),
                                                              u.shuffle, &u));
    for (int64_t k = inside; k < gs / 8; k++)
        _mm256_storeu_ps(q + 8 * k, unit_floats_avx2(bytes, k, bits, group_bytes, &u));
}

static void unpack_group_avx2(const uint8_t *bytes, int64_t gs, int bits, float *q) {
    switch (bits) { /* constant widths: the byte copy becomes one load */
    case 2: unpack_units_avx2(bytes, gs, 2, q); break;
    case 3: unpack_units_avx2(bytes, gs, 3, q); break;
    case 4: unpack_units_avx2(bytes, gs, 4, q); break;
    case 5: unpack_units_avx2(bytes, gs, 5, q); break;
    case 6: unpack_units_avx2(bytes, gs, 6, q); break;
    case 8:
        for (int64_t j = 0; j < gs; j += 8) {
            const __m128i b8 = _mm_loadl_epi64((const __m128i *)(bytes + j));
            _mm256_storeu_ps(q + j, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8)));
        }
        break;
    default: unpack_group(bytes, gs, bits, q);
    }
}
#endif

/* Unpacks groups of one width: with VBMI (else AVX2) unless `portable` or the CPU lacks both. */
typedef struct {
    int bits, portable;
#ifdef DQ_HAVE_VBMI
    unpacker simd;
#endif
} group_unpacker;

static inline group_unpacker make_group_unpacker(int bits, int portable) {
    group_unpacker g;
    g.bits = bits;
    g.portable = portable;
#ifdef DQ_HAVE_VBMI
    g.simd = make_unpacker(bits);
#endif
    return g;
}

static inline void unpack_codes_as_floats(const group_unpacker *g, const uint8_t *bytes,
                                          int64_t gs, float *q) {
#ifdef DQ_HAVE_VBMI
    if (!g->portable) {
        unpack_group_vbmi(bytes, gs, g->bits, &g->simd, q);
        return;
    }
#elif defined(DQ_HAVE_AVX2)
    if (!g->portable) {
        unpack_group_avx2(bytes, gs, g->bits, q);
        return;
    }
#endif
    unpack_group(bytes, gs, g->bits, q);
}

/* A whole group dequantized into dst: w = q * scale + offset (float32 multiply, then add: the
 * format's dequantization). */
static inline void dequantize_group(const group_unpacker *g, const uint8_t *bytes, int64_t gs,
                                    uint16_t scale, uint16_t offset, float *dst) {
    unpack_codes_as_floats(g, bytes, gs, dst);
    const float s = bf16_value(scale), o = bf16_value(offset);
    for (int64_t j = 0; j < gs; j++) dst[j] = dst[j] * s + o;
}

/* 2: AVX-512 VBMI unpacking, 1: AVX2, 0: portable only. */
static inline int dq_has_simd(void) {
#ifdef DQ_HAVE_VBMI
    return 2;
#elif defined(DQ_HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}
#endif /* DQ_UNPACK_H */
