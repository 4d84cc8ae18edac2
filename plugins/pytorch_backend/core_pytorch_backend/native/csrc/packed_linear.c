/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept as 4- or 8-bit codes per group of 32 inputs.
 *
 * A weight element is w = q * s + o (q the unsigned code, s and o one float each per row and group);
 * with no offset array, o = -zero_point * s (GGUF Q4_0 / Q8_0 and symmetric int8). The activations are
 * quantized per row and group of 32 in two int8 steps: x ~ d * q1 (d = max|x| / 127, llama.cpp's Q8
 * activations) and the rest, x - d * q1, ~ (d / 127) * q2. So x ~ (d / 127) * (127 q1 + q2), within
 * max|x| / 32258 (where one step alone loses up to max|x| / 254, which in every layer of a model costs
 * a point of top-1 agreement). A group's contribution is s * (d / 127) * (127 sum(q * q1) + sum(q * q2))
 * + o * sum(x): two integer dot products, one multiply by the two scales, and a short dot of the
 * offsets with the groups' float sums.
 *
 * Layouts (K padded to Kp, a multiple of 64, with zero codes, scales and offsets):
 *   bits == 4: codes [N][Kp / 2], byte j of the 32-byte pair p of row n holds group 2p's code j in its
 *              low nibble and group 2p+1's code j in its high nibble;
 *   bits == 8: codes [N][Kp], one byte per code;
 *   scale, offset: float [N][Kp / 32].
 *
 * The inner loops, chosen at compile time by the flags the build passes: AVX-512 VNNI (vpdpbusd, 64
 * multiply-adds a step), AVX2 (vpmaddubsw / vpmaddwd) or plain C (the reference the tests compare with).
 * Rows of W are split among OpenMP threads (the process's one libgomp, torch's, so torch.set_num_threads
 * applies); activation rows are taken 1 or 4 at a time so that each unpacked weight vector serves them all.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define CORE_PACKED_ABI 3
#define GROUP 32
#define PAIR 64
#define TILE 4


int core_packed_abi_version(void) { return CORE_PACKED_ABI; }

const char *core_packed_variant(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

/* Activations quantized: q and q2 [Mp][Kp] int8 (the two steps), d [Mp][G] (the combined code's scale,
 * max|x| / 127^2) and sum [Mp][G] (the group's float sum), and
 * for the AVX-512 loop d spread per lane: lanes [Mp][Kp / 4] (16 floats per pair: 8 x d(2p), 8 x d(2p+1)). */
typedef struct {
    int8_t *q, *q2;
    float *d;
    float *sum;
    float *lanes;
    int64_t rows, kp, groups;
} acts_t;

static inline float load_x(const void *x, int dtype, int64_t index) {
    return dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[index]) : ((const float *)x)[index];
}

static void quantize_row(const void *x, int dtype, int64_t row, int64_t k, acts_t *a) {
    float buf[GROUP];
    int8_t *q = a->q + row * a->kp, *q2 = a->q2 + row * a->kp;
    for (int64_t g = 0; g < a->groups; ++g) {
        float amax = 0.f;
        for (int j = 0; j < GROUP; ++j) {
            int64_t col = g * GROUP + j;
            buf[j] = col < k ? load_x(x, dtype, row * k + col) : 0.f;
            float v = fabsf(buf[j]);
            amax = v > amax ? v : amax;
        }
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        float total = 0.f;
        for (int j = 0; j < GROUP; ++j) {
            int v = (int)lrintf(buf[j] * inv);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            int rest = (int)lrintf((buf[j] - d * (float)v) * inv * 127.f); /* |rest| <= 64 */
            rest = rest > 127 ? 127 : (rest < -127 ? -127 : rest);
            q[g * GROUP + j] = (int8_t)v;
            q2[g * GROUP + j] = (int8_t)rest;
            total += buf[j];
        }
        a->d[row * a->groups + g] = d / 127.f;
        a->sum[row * a->groups + g] = total;
        float *lanes = a->lanes + row * (a->kp / 4) + (g / 2) * 16 + (g % 2) * 8;
        for (int j = 0; j < 8; ++j) lanes[j] = d / 127.f;
    }
}

static int quantize_acts(const void *x, int dtype, int64_t m, int64_t k, int64_t kp, acts_t *a) {
    a->rows = (m + TILE - 1) / TILE * TILE; /* padded rows are zero: a tile never reads past the end */
    a->kp = kp;
    a->groups = kp / GROUP;
    a->q = calloc((size_t)(a->rows * kp), 1);
    a->q2 = calloc((size_t)(a->rows * kp), 1);
    a->d = calloc((size_t)(a->rows * a->groups), sizeof(float));
    a->sum = calloc((size_t)(a->rows * a->groups), sizeof(float));
    a->lanes = calloc((size_t)(a->rows * kp / 4), sizeof(float));
    if (!a->q || !a->q2 || !a->d || !a->sum || !a->lanes) return ERR_MEMORY;
#pragma omp parallel for schedule(static) if (m * k > 65536)
    for (int64_t row = 0; row < m; ++row) quantize_row(x, dtype, row, k, a);
    return OK;
}

static void free_acts(acts_t *a) {
    free(a->q);
    free(a->q2);
    free(a->d);
    free(a->sum);
    free(a->lanes);
}

/* sum over groups of o[g] * sum[g] (o = -zero_point * s when there is no offset array) */
static inline float offset_term(const float *s, const float *o, float zero_point, const float *sum, int64_t groups) {
    float total = 0.f;
    if (o) {
        for (int64_t g = 0; g < groups; ++g) total += o[g] * sum[g];
    } else {
        for (int64_t g = 0; g < groups; ++g) total += s[g] * sum[g];
        total *= -zero_point;
    }
    return total;
}

/* integer dot of group g of a weight row with an activation row's codes (plain C) */
static inline int32_t group_dot(const uint8_t *w, int bits, int64_t g, const int8_t *xq) {
    int32_t total = 0;
    if (bits == 4) {
        const uint8_t *pair = w + (g / 2) * GROUP;
        int shift = (g % 2) * 4;
        for (int j = 0; j < GROUP; ++j) total += (int32_t)((pair[j] >> shift) & 0x0f) * xq[g * GROUP + j];
    } else {
        for (int j = 0; j < GROUP; ++j) total += (int32_t)w[g * GROUP + j] * xq[g * GROUP + j];
    }
    return total;
}

static inline void row_dots_generic(const uint8_t *w, int bits, const float *s, const acts_t *a, int64_t m0,
                                    int tile, float *out) {
    for (int i = 0; i < tile; ++i) {
        const int8_t *xq = a->q + (m0 + i) * a->kp, *xq2 = a->q2 + (m0 + i) * a->kp;
        const float *d = a->d + (m0 + i) * a->groups;
        float total = 0.f;
        for (int64_t g = 0; g < a->groups; ++g)
            total += s[g] * d[g] * (float)(127 * group_dot(w, bits, g, xq) + group_dot(w, bits, g, xq2));
        out[i] = total;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* the 64 codes of pair p as bytes: group 2p in the low 256 bits, group 2p+1 in the high */
static inline __m512i load_codes(const uint8_t *w, int bits, int64_t p) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(w + p * PAIR));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256i raw = _mm256_loadu_si256((const __m256i *)(w + p * GROUP));
    __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __attribute__((always_inline)) void row_dots_simd(const uint8_t *w, int bits, const float *s,
                                                                 const acts_t *a, int64_t m0, int tile,
                                                                 float *out) {
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[TILE];
    for (int i = 0; i < tile; ++i) acc[i] = _mm512_setzero_ps();
    const int64_t pairs = a->kp / PAIR, lane_stride = a->kp / 4;
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i codes = load_codes(w, bits, p);
        __m128 s2 = _mm_castpd_ps(_mm_load_sd((const double *)(s + 2 * p)));
        __m512 ws = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s2));
        for (int i = 0; i < tile; ++i) {
            const int64_t at = (m0 + i) * a->kp + p * PAIR;
            __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512((const void *)(a->q + at)));
            __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512((const void *)(a->q2 + at)));
            __m512i dot = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 7), hi), lo); /* 127 hi + lo */
            __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(a->lanes + (m0 + i) * lane_stride + p * 16));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
        }
    }
    for (int i = 0; i < tile; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#elif defined(__AVX2__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 int32 partial sums of group g: codes (u8) times activation codes (s8) */
static inline __m256i group_dot256(const uint8_t *w, int bits, int64_t g, const int8_t *xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(w + (g / 2) * GROUP));
        __m256i codes = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0f));
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones); /* 15 * 127 * 2 fits int16 */
    }
    const uint8_t *c = w + g * GROUP;
    const int8_t *x = xq + g * GROUP;
    __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c)),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x)));
    __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 16))),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 16))));
    return _mm256_add_epi32(lo, hi);
}

static inline __attribute__((always_inline)) void row_dots_simd(const uint8_t *w, int bits, const float *s,
                                                                 const acts_t *a, int64_t m0, int tile,
                                                                 float *out) {
    __m256 acc[TILE];
    for (int i = 0; i < tile; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a->groups; ++g) {
        for (int i = 0; i < tile; ++i) {
            __m256i hi = group_dot256(w, bits, g, a->q + (m0 + i) * a->kp);
            __m256i lo = group_dot256(w, bits, g, a->q2 + (m0 + i) * a->kp);
            __m256i dot = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 7), hi), lo); /* 127 hi + lo */
            __m256 scale = _mm256_set1_ps(s[g] * a->d[(m0 + i) * a->groups + g]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i]);
        }
    }
    for (int i = 0; i < tile; ++i) out[i] = hsum256(acc[i]);
}
#else
#define row_dots_simd row_dots_generic
#endif

static inline void store_y(void *y, int dtype, int64_t index, float v) {
    if (dtype == DT_BF16)
        ((uint16_t *)y)[index] = f32_to_bf16(v);
    else
        ((float *)y)[index] = v;
}

/* one weight row n against every activation row, `tile` rows at a time (tile a compile-time constant) */
static inline __attribute__((always_inline)) void weight_row(const uint8_t *codes, int bits, const float *scale,
                                                              const float *offset, float zero_point,
                                                              const float *bias, const acts_t *a, int64_t m,
                                                              int64_t n, int64_t n_total, void *y, int y_dtype,
                                                              int tile, int reference) {
    const int64_t row_bytes = bits == 4 ? a->kp / 2 : a->kp;
    const uint8_t *w = codes + n * row_bytes;
    const float *s = scale + n * a->groups, *o = offset ? offset + n * a->groups : NULL;
    float dots[TILE];
    for (int64_t m0 = 0; m0 < m; m0 += tile) {
        if (reference)
            row_dots_generic(w, bits, s, a, m0, tile, dots);
        else
            row_dots_simd(w, bits, s, a, m0, tile, dots);
        for (int i = 0; i < tile && m0 + i < m; ++i) {
            float v = dots[i] + offset_term(s, o, zero_point, a->sum + (m0 + i) * a->groups, a->groups);
            store_y(y, y_dtype, (m0 + i) * n_total + n, bias ? v + bias[n] : v);
        }
    }
}

static int packed_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                         int64_t n, int64_t kp, const float *scale, const float *offset, float zero_point,
                         const float *bias, void *y, int y_dtype, int reference) {
    if ((m > 0 && (!x || !y)) || !codes || !scale || m < 0 || k <= 0 || n <= 0 || kp < k || kp % PAIR ||
        (bits != 4 && bits != 8) || (x_dtype != DT_F32 && x_dtype != DT_BF16) ||
        (y_dtype != DT_F32 && y_dtype != DT_BF16))
        return ERR_ARGS;
    if (m == 0) return OK;
    acts_t a;
    int status = quantize_acts(x, x_dtype, m, k, kp, &a);
    if (status == OK) {
        const int tile = m >= TILE ? TILE : 1;
#pragma omp parallel for schedule(static)
        for (int64_t row = 0; row < n; ++row) {
            if (tile == TILE)
                weight_row(codes, bits, scale, offset, zero_point, bias, &a, m, row, n, y, y_dtype, TILE, reference);
            else
                weight_row(codes, bits, scale, offset, zero_point, bias, &a, m, row, n, y, y_dtype, 1, reference);
        }
    }
    free_acts(&a);
    return status;
}

/* y = x @ W^T + bias with the fastest loop this build has; returns 0, or 1 (bad arguments), 2 (memory). */
int core_packed_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                       int64_t n, int64_t kp, const float *scale, const float *offset, float zero_point,
                       const float *bias, void *y, int y_dtype) {
    return packed_linear(x, x_dtype, m, k, codes, bits, n, kp, scale, offset, zero_point, bias, y, y_dtype, 0);
}

/* The same with the plain C loop: the reference the SIMD loops are tested against. */
int core_packed_linear_reference(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                                 int64_t n, int64_t kp, const float *scale, const float *offset, float zero_point,
                                 const float *bias, void *y, int y_dtype) {
    return packed_linear(x, x_dtype, m, k, codes, bits, n, kp, scale, offset, zero_point, bias, y, y_dtype, 1);
}
