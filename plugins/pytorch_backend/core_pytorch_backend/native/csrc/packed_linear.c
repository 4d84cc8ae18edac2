/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept as 4- or 8-bit codes per group of 32 inputs.
 *
 * A weight element is w = q * s + o (q the unsigned code, s and o one float each per row and group;
 * a symmetric code has o = -zero_point * s, filled in when the weight is packed). The activations are
 * quantized per row and group of 32 in two int8 steps: x ~ d * q1 (d = max|x| / 127, llama.cpp's Q8
 * activations) and the rest, x - d * q1, ~ (d / B) * q2, B = ACTS_BASE (127; 16 for 4-bit codes on builds
 * with exact int8 tiles). So x ~ (d / B) * (B q1 + q2), within max|x| / 32258 (B = 127; 4064 for 16), where one step
 * alone loses up to max|x| / 254, which in every layer of a model costs a point of top-1 agreement. (Nor can
 * some layers take one step: teacher-forced top-1 agreement of the default model with its float32 oracle, every
 * row on this loop, 2,000 tokens, Zen 4 EPYC: 99.75% with two steps everywhere; 98.10% with one for the inputs
 * of q/k/v and gate/up, whose normed rows carry the outliers; 99.25% with one for the down projection's only.
 * Simulated by rounding those inputs to one step before the call, whose quantization then leaves them as
 * they are.) A group's contribution is s * (d / B) * (B sum(q * q1) + sum(q * q2)) + o * sum(x): two integer dot
 * products, one multiply by the two scales, and one multiply-add of the offset by the group's float sum.
 *
 * Layout: 16 weight rows side by side (a "block"), so that one vector holds 16 rows' partial dots and
 * no horizontal sum is ever needed. N is padded to Np (a multiple of 16) and K to Kp (a multiple of 64)
 * with zero codes, scales and offsets; G = Kp / 32 groups, P = Kp / 64 pairs of groups.
 *   bits == 8: codes [Np/16][G][8][16][4]: block b, group g, step j, row r, byte t holds the code of
 *              row 16b + r at input 32g + 4j + t;
 *   bits == 4: codes [Np/16][P][8][16][4]: the same with two groups to a byte: the low nibble holds
 *              group 2p's code at input 64p + 4j + t, the high nibble group 2p+1's at 64p + 32 + 4j + t;
 *   scale, offset: [Np/16][G][16], float32 or float16 (half the bytes: GGUF's own scales are halves);
 *              or factored (DT_S8_32, DT_S8_16: GGUF's K-quants, whose scales are d * sc, an int8 sc under one
 *              d a super-block of 256 inputs): per block and super-block, its groups' 16 rows' int8 codes, then
 *              the 16 rows' float32 units, [Np/16][Kp/256][groups a super-block x 16 + 64] bytes; a value is
 *              code * unit in float32, the file's own (exact: an fp16 d times an int8 needs 19 of 24 bits).
 *
 * 8-bit codes may instead have a scale and offset per 16 inputs (group 16: GGUF's Q6_K, whose 6-bit codes
 * sit under one of 16 scales a 256-input super-block, kept exactly): scale, offset [Np/16][2G][16], and
 * each group of 32 folds its two halves' integer dots apart, each with its half's scale and offset and
 * the half's float sum of the activations (which keep one d per 32 inputs).
 *
 * bits == 16: 16-bit float weights with no scales (scale_dtype names theirs, DT_BF16 or DT_F16): half_linear.c.
 *
 * Every output is computed the same way whatever M is (the activation rows are independent and each
 * sums its groups in order), so a row's result does not depend on the batch it is in.
 *
 * The inner loops, chosen at compile time by the flags the build passes: AVX-512 VNNI (vpdpbusd: 16
 * rows x 4 inputs a step), AVX2 (vpmaddubsw / vpmaddwd on 8 rows at a time) or plain C (the reference
 * the tests compare with). Blocks are split among OpenMP threads (the process's one libgomp, torch's,
 * so torch.set_num_threads applies); activation rows are taken up to TILE at a time, so that each
 * unpacked weight vector serves them all, and on AVX-512 two blocks at a time (TILE_BLOCKS), so that
 * each broadcast of a row's activation codes serves both.
 */
#if defined(__AMX_TILE__)
#define _DEFAULT_SOURCE /* syscall (arch_prctl) */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#include "common.h"
#include "amx.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define CORE_PACKED_ABI 23
#define ERR_NO_TILES 3
#define GROUP 32
#define PAIR 64
#define BLOCK 16 /* weight rows per block */
#define STEP_BYTES (BLOCK * 4)
#define ACTS_CHUNK_BYTES (96 * 1024) /* activation codes (q1 and q2) of the rows a thread takes at a time */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TILE 4
#define TILE_BLOCKS 2 /* weight blocks a tile: each activation broadcast serves both */
#else
#define TILE 2
#define TILE_BLOCKS 1
#endif
#define TWO_BLOCK_ROWS 16 /* tiles of TILE_BLOCKS from this many activation rows on (see packed_linear) */
#define EXACT_TILES_ROWS 16 /* activation rows of the exact tile loop's A tiles (amx.h's AMX_ROWS) */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define EXACT_TILES 1 /* the VNNI loop's integer dots also on the AMX tiles (exact_tile_outputs) */
#else
#define EXACT_TILES 0
#endif
/* The activations' second step for a weight of `bits`-bit codes: x ~ (d / base) (base q1 + q2), q2 the rest in
 * units of d / base. 127 (max|x| / 32258 at worst); 16 for 4-bit codes on builds with exact int8 tiles
 * (max|x| / 4064), where 16 times a 4-bit code is still a byte, so that the exact tiles take a group's two
 * steps in one tile product of 64 inputs (exact_block_dots_fused) and fold one int32 dot, not two. 8-bit codes
 * (Q8_0, Q5, Q6_K, the LM head) would gain nothing and keep 127. Top-1 agreement of the default model with its
 * float32 oracle, every row on the VNNI loop (benchmarks/quant_accuracy.py on the AMX Xeon): 99.75% -> 99.70%,
 * perplexity ratio 1.0005 -> 0.9999 (16 for the LM head too: 99.40%; the bf16 tile loop, which prompt tokens take
 * on those builds, 99.45%). */
#define ACTS_BASE(bits) (EXACT_TILES && (bits) == 4 ? 16 : 127)
/* A thread's share of a call (its contiguous blocks, as schedule(static)) is cut into units of a chunk of
 * rows by this many blocks, taken in order; a thread done with its share takes the units left of the
 * others'. Where the OS takes a thread away for a while (the server's event loop, clients on the same
 * cores), the other goes on with its work instead of waiting at the end of the call: a prefill step of
 * 32 prompts of 128 tokens beside a process busy 2 ms of every 10 took 3.68 s instead of 3.95 on a
 * 2-core Zen 4 EPYC (alone, the same). Even, so that tiles of two blocks stay whole. Every output is
 * computed as before, whichever thread takes it. */
#define SHARE_UNIT_BLOCKS 8
#define TAKEN_APART 8 /* the shares' counters a cache line apart */


int core_packed_abi_version(void) { return CORE_PACKED_ABI; }

/* ACTS_BASE(bits): the activations' second step, x ~ (d / base) (base q1 + q2), for a weight of `bits`-bit codes */
int core_packed_acts_base(int bits) { return ACTS_BASE(bits); }

const char *core_packed_variant(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "amx-bf16";
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    return "avx512-bf16";
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

/* Activations quantized: q1 and q2 [M][Kp] int8 (the two steps), d [M][G] (the combined code's scale,
 * max|x| / (127 base)), sum [M][G] (the group's float sum) and csum [M][G] (127 sum(q1): what the AVX2
 * loop's centred 8-bit codes leave out of 127 hi); for a weight of 16-input groups also sum16 and
 * csum16 [M][2G], the same per half group (else NULL). */
typedef struct {
    int8_t *q1, *q2, *q12; /* q12: [M][G][64], each group's q1 then q2 (the fused exact tiles' A rows), or NULL */
    float *d, *sum, *sum16;
    int32_t *csum, *csum16;
    int64_t kp, groups;
    int base; /* ACTS_BASE of the weight's codes */
} acts_t;

/* A weight's scales and offsets, float32 or float16 (dtype DT_F32 / DT_F16). Whether they cover 16 inputs
 * each (`halves`) travels apart: with a fourth field GCC stopped passing this one in registers, and the
 * loops of 32-input groups read it from the stack (1-2% slower at 32-64 rows, Zen 4 EPYC). */
typedef struct {
    const void *s, *o;
    int dtype;
} scales_t;

/* groups a super-block of 256 inputs holds in a factored layout of `dtype` */
static inline int64_t factored_groups(int dtype) { return dtype == DT_S8_16 ? 16 : 8; }

/* The super-block of a factored layout that holds element `index` (block b, group g, row r: (b G + g) 16 + r): its
 * groups' codes (16 a group), then its 16 units; *code_at: where `index`'s group's codes start */
static inline const uint8_t *factored_super(const void *p, int dtype, int64_t index, const int8_t **code_at) {
    const int64_t per = factored_groups(dtype), row_group = index >> 4, first = row_group / per;
    const uint8_t *super = (const uint8_t *)p + first * (per * 16 + 64);
    *code_at = (const int8_t *)super + (row_group - first * per) * 16;
    return super + per * 16;
}

static inline float scale_at(const void *p, int dtype, int64_t index) {
    if (dtype == DT_S8_32 || dtype == DT_S8_16) {
        const int8_t *codes;
        const float *units = (const float *)factored_super(p, dtype, index, &codes);
        return (float)codes[index & 15] * units[index & 15];
    }
    return dtype == DT_F16 ? f16_to_f32(((const uint16_t *)p)[index]) : ((const float *)p)[index];
}

static inline float load_x(const void *x, int dtype, int64_t index) {
    return dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[index]) : ((const float *)x)[index];
}

/* one group's codes, scale and sum from its 32 floats (plain C: the reference, and a partial last group) */
static void quantize_group_generic(const float *buf, int base, int8_t *q1, int8_t *q2, float *d_out,
                                   float *sum_out, int32_t *csum_out) {
    float amax = 0.f;
    for (int j = 0; j < GROUP; ++j) {
        float v = fabsf(buf[j]);
        amax = v > amax ? v : amax;
    }
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    float total = 0.f;
    int32_t codes = 0;
    for (int j = 0; j < GROUP; ++j) {
        int v = (int)lrintf(buf[j] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        int rest = (int)lrintf((buf[j] - d * (float)v) * inv * (float)base); /* |rest| <= 63.5 + rounding */
        rest = rest > 64 ? 64 : (rest < -64 ? -64 : rest); /* a bound the AVX2 8-bit loop relies on */
        q1[j] = (int8_t)v;
        q2[j] = (int8_t)rest;
        total += buf[j];
        codes += base * v;
    }
    *d_out = d / (float)base;
    *sum_out = total;
    *csum_out = codes;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512 load16x(const void *x, int dtype, int64_t index) {
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + index))), 16));
    return _mm512_loadu_ps((const float *)x + index);
}

/* The same as quantize_group_generic (the same rounding of the same products: codes equal), the group's 32
 * inputs in two vectors; only the group's sum is added up in another order. No csum: the VNNI loops do not
 * read it. Half the instructions of the 8-lane loop below: on a Zen 4 EPYC a call that is mostly
 * quantization (64 rows of K = 1536, 16 outputs) 64 -> 56 us, a decode step ~1% faster. */
static void quantize_group_simd(const void *x, int dtype, int64_t index, int base_codes, int8_t *q1, int8_t *q2,
                                float *d_out, float *sum_out, int32_t *csum_out) {
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    const __m512i rest_top = _mm512_set1_epi32(64), rest_bottom = _mm512_set1_epi32(-64);
    const __m512 v[2] = {load16x(x, dtype, index), load16x(x, dtype, index + 16)};
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float d = a / 127.f, inv_s = a > 0.f ? 127.f / a : 0.f;
    const __m512 inv = _mm512_set1_ps(inv_s), dv = _mm512_set1_ps(d), base = _mm512_set1_ps((float)base_codes);
    for (int i = 0; i < 2; ++i) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv)); /* round to nearest even, as lrintf */
        q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
        __m512 rest = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(v[i], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(q))), inv), base);
        __m512i r = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(rest), rest_top), rest_bottom);
        _mm_storeu_si128((__m128i *)(q1 + 16 * i), _mm512_cvtsepi32_epi8(q));
        _mm_storeu_si128((__m128i *)(q2 + 16 * i), _mm512_cvtsepi32_epi8(r));
    }
    *csum_out = 0;
    *d_out = d / (float)base_codes;
    *sum_out = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
}
#elif defined(__AVX2__)
static inline __m256 load8(const void *x, int dtype, int64_t index) {
    if (dtype == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + index))), 16));
    return _mm256_loadu_ps((const float *)x + index);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* 4 x 8 int32 (each within +-127) -> 32 int8 in order */
static inline void store_codes(int8_t *out, const __m256i v[4]) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, bytes);
}

/* The same as quantize_group_generic (the same rounding of the same products: codes equal), 8 lanes at
 * a time; only the group's sum is added up in another order. */
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1)));
}

static void quantize_group_simd(const void *x, int dtype, int64_t index, int base_codes, int8_t *q1, int8_t *q2,
                                float *d_out, float *sum_out, int32_t *csum_out) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    const __m256i rest_top = _mm256_set1_epi32(64), rest_bottom = _mm256_set1_epi32(-64);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = load8(x, dtype, index + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    const float a = hmax8(amax), d = a / 127.f, inv_s = a > 0.f ? 127.f / a : 0.f;
    const __m256 inv = _mm256_set1_ps(inv_s), dv = _mm256_set1_ps(d), base = _mm256_set1_ps((float)base_codes);
    __m256i c1[4], c2[4];
    for (int i = 0; i < 4; ++i) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* round to nearest even, as lrintf */
        q = _mm256_max_epi32(_mm256_min_epi32(q, top), bottom);
        __m256 rest = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q))), inv), base);
        c1[i] = q;
        c2[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(rest), rest_top), rest_bottom);
    }
    store_codes(q1, c1);
    store_codes(q2, c2);
    const __m256i k = _mm256_set1_epi32(base_codes);
    __m256i codes = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) codes = _mm256_add_epi32(codes, _mm256_mullo_epi32(c1[i], k));
    *csum_out = hsum8_epi32(codes); /* the AVX2 loop's centred 8-bit codes leave it out */
    *d_out = d / (float)base_codes;
    *sum_out = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}
#endif

/* Row `row`'s sum16 and csum16 (see acts_t): each half group's float sum, in order, and 127 sum(q1) */
static void half_sums(const void *x, int dtype, int64_t row, int64_t k, acts_t *a) {
    for (int64_t h = 0; h < 2 * a->groups; ++h) {
        float total = 0.f;
        int32_t codes = 0;
        for (int64_t col = h * (GROUP / 2); col < (h + 1) * (GROUP / 2); ++col) {
            total += col < k ? load_x(x, dtype, row * k + col) : 0.f;
            codes += a->base * a->q1[row * a->kp + col];
        }
        a->sum16[row * 2 * a->groups + h] = total;
        a->csum16[row * 2 * a->groups + h] = codes;
    }
}

static void quantize_row(const void *x, int dtype, int64_t row, int64_t k, acts_t *a, int reference) {
    float buf[GROUP];
    int8_t *q1 = a->q1 + row * a->kp, *q2 = a->q2 + row * a->kp;
    float *d = a->d + row * a->groups, *sum = a->sum + row * a->groups;
    int32_t *csum = a->csum + row * a->groups;
    for (int64_t g = 0; g < a->groups; ++g) {
#if defined(__AVX2__)
        if (!reference && (g + 1) * GROUP <= k) {
            quantize_group_simd(x, dtype, row * k + g * GROUP, a->base, q1 + g * GROUP, q2 + g * GROUP, d + g,
                                sum + g, csum + g);
            continue;
        }
#endif
        for (int j = 0; j < GROUP; ++j) {
            int64_t col = g * GROUP + j;
            buf[j] = col < k ? load_x(x, dtype, row * k + col) : 0.f;
        }
        quantize_group_generic(buf, a->base, q1 + g * GROUP, q2 + g * GROUP, d + g, sum + g, csum + g);
    }
    if (a->sum16) half_sums(x, dtype, row, k, a);
}

/* room for m rows' activation codes, scales and sums (and half sums: `halves`), in one allocation */
static int alloc_acts(int64_t m, int64_t kp, int halves, int base, acts_t *a) {
    a->kp = kp;
    a->base = base;
    a->groups = kp / GROUP;
    const size_t per_group = (size_t)(m * a->groups), per_half = halves ? 2 * per_group : 0;
    char *block = malloc((per_group + per_half) * (2 * sizeof(float) + sizeof(int32_t)) + (size_t)(2 * m * kp));
    if (!block) return ERR_MEMORY;
    a->d = (float *)block;
    a->sum = a->d + per_group;
    a->csum = (int32_t *)(a->sum + per_group);
    a->sum16 = halves ? (float *)(a->csum + per_group) : NULL;
    a->csum16 = halves ? (int32_t *)(a->sum16 + per_half) : NULL;
    a->q1 = (int8_t *)(a->csum + per_group) + per_half * (sizeof(float) + sizeof(int32_t));
    a->q2 = a->q1 + m * kp;
    a->q12 = NULL;
    return OK;
}

static void free_acts(acts_t *a) {
    free(a->d); /* the allocation starts at d */
    free(a->q12);
}

/* rows [m0, m1) quantized (called by each thread of a team for its share) */
static void quantize_rows(const void *x, int dtype, int64_t m0, int64_t m1, int64_t k, acts_t *a, int reference) {
    for (int64_t row = m0; row < m1; ++row) quantize_row(x, dtype, row, k, a, reference);
}

/* the activation codes at input `at` of row `row`, 4 bytes as one int32 (read in place, so that the
 * compiler can fold it into the multiply-add as a broadcast memory operand) */
typedef int32_t __attribute__((may_alias, aligned(1))) int32_unaligned;

static inline int32_t x4(const int8_t *q, int64_t kp, int64_t row, int64_t at) {
    return *(const int32_unaligned *)(q + row * kp + at);
}

/* The code of block row r at input `col` (plain C). */
static inline int32_t code_at(const uint8_t *block, int bits, int64_t r, int64_t col) {
    const int64_t j = (col % GROUP) / 4, t = col % 4;
    if (bits == 8) return block[((col / GROUP) * 8 + j) * STEP_BYTES + r * 4 + t];
    const uint8_t byte = block[((col / PAIR) * 8 + j) * STEP_BYTES + r * 4 + t];
    return (col % PAIR) < GROUP ? (byte & 0x0f) : (byte >> 4);
}

/* out[i][r] for `tile` activation rows from m0 and the 16 rows of one block (plain C, the reference). Not
 * inlined: inlined into block_outputs, it changed how the SIMD loops there were compiled (AVX2 10-15% slower). */
static __attribute__((noinline)) void block_dots_generic(const uint8_t *block, int bits, scales_t w, int halves,
                                                         int64_t base, const acts_t *a, int64_t m0, int tile,
                                                         float out[][TILE_BLOCKS * BLOCK]) {
    for (int i = 0; i < tile; ++i) {
        const int64_t row = m0 + i;
        for (int r = 0; r < BLOCK; ++r) {
            float total = 0.f;
            const int64_t parts = halves ? 2 : 1, width = GROUP / parts; /* a group's halves fold apart */
            for (int64_t g = 0; g < a->groups * parts; ++g) {
                int32_t hi = 0, lo = 0;
                for (int64_t c = g * width; c < (g + 1) * width; ++c) {
                    const int32_t w = code_at(block, bits, r, c);
                    hi += w * a->q1[row * a->kp + c];
                    lo += w * a->q2[row * a->kp + c];
                }
                const float sum = halves ? a->sum16[row * 2 * a->groups + g] : a->sum[row * a->groups + g];
                const float scale = scale_at(w.s, w.dtype, base + g * BLOCK + r) * a->d[row * a->groups + g / parts];
                total = fmaf((float)(a->base * hi + lo), scale, total);
                total = fmaf(scale_at(w.o, w.dtype, base + g * BLOCK + r), sum, total);
            }
            out[i][r] = total;
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* one group's integer dot (base sum(q * q1) + sum(q * q2)) folded into the float sums: acc += dot * s * d
 * + o * sum */
static inline __m512 fold_dot(__m512 acc, __m512i dot, __m512 s, __m512 o, float d, float sum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(d)), acc);
    return _mm512_fmadd_ps(o, _mm512_set1_ps(sum), acc);
}

/* the same from its two steps' dots (base 16 or 127: ACTS_BASE) */
static inline __m512 fold_group(__m512 acc, __m512i hi, __m512i lo, __m512 s, __m512 o, float d, float sum,
                                int base) {
    const __m512i dot = base == 16 ? _mm512_add_epi32(_mm512_slli_epi32(hi, 4), lo)
                                   : _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 7), hi), lo);
    return fold_dot(acc, dot, s, o, d, sum);
}

/* 16 scales (or offsets) from element `index` */
static inline __m512 load16(const void *p, int dtype, int64_t index) {
    if (dtype == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + index)));
    if (dtype == DT_S8_32 || dtype == DT_S8_16) { /* index is a group's first row (16 | index) */
        const int8_t *codes;
        const float *units = (const float *)factored_super(p, dtype, index, &codes);
        const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
        return _mm512_mul_ps(values, _mm512_loadu_ps(units));
    }
    return _mm512_loadu_ps((const float *)p + index);
}

/* step j of group g: 16 rows x 4 codes as bytes (4-bit codes: the nibble of the pair's bytes that holds g) */
static inline __m512i step_codes(const uint8_t *block, int bits, int64_t g, int j) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(block + (g * 8 + j) * STEP_BYTES));
    __m512i raw = _mm512_loadu_si512((const void *)(block + ((g / 2) * 8 + j) * STEP_BYTES));
    return _mm512_and_si512(g % 2 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0f));
}

/* out[i][16 b + r] for `tile` activation rows from m0 and the 16 rows of each of `blocks` weight blocks
 * (block b at first + b * block_bytes), one group at a time: two integer accumulators (q1, q2) per activation
 * row and block. Each broadcast of a row's 4 activation codes serves every block of the tile, so that
 * a multiply-add needs ~0.6 loads instead of ~1.1 (the loads, not the multiply-adds, bound the loop of
 * one block). (Both groups of a pair at once, four accumulators a row, spilled to the stack and ran 1.5x
 * slower; 8 rows a tile spill too.) */
static inline __attribute__((always_inline)) void tile_dots(const uint8_t *first, int64_t block_bytes, int blocks,
                                                             int bits, scales_t w, int64_t base, const acts_t *a,
                                                             int64_t m0, int tile, float out[][TILE_BLOCKS * BLOCK],
                                                             const int halves) {
    const int64_t kp = a->kp, groups = a->groups, scales_apart = (halves ? 2 : 1) * groups * BLOCK;
    __m512 acc[TILE][TILE_BLOCKS];
    for (int i = 0; i < tile; ++i)
        for (int b = 0; b < blocks; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i hi[TILE][TILE_BLOCKS], lo[TILE][TILE_BLOCKS];
        for (int i = 0; i < tile; ++i)
            for (int b = 0; b < blocks; ++b) hi[i][b] = lo[i][b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i codes[TILE_BLOCKS];
            for (int b = 0; b < blocks; ++b) codes[b] = step_codes(first + b * block_bytes, bits, g, j);
            const int64_t at = g * GROUP + 4 * j;
            for (int i = 0; i < tile; ++i) {
                const __m512i x1 = _mm512_set1_epi32(x4(a->q1, kp, m0 + i, at)),
                              x2 = _mm512_set1_epi32(x4(a->q2, kp, m0 + i, at));
                for (int b = 0; b < blocks; ++b) {
                    hi[i][b] = _mm512_dpbusd_epi32(hi[i][b], codes[b], x1);
                    lo[i][b] = _mm512_dpbusd_epi32(lo[i][b], codes[b], x2);
                }
            }
            if (halves && (j == 3 || j == 7)) { /* a half group's dots folded with its own scale and offset */
                const int64_t half = 2 * g + j / 4;
                for (int b = 0; b < blocks; ++b) {
                    const int64_t at_s = base + b * scales_apart + half * BLOCK;
                    const __m512 sg = load16(w.s, w.dtype, at_s), og = load16(w.o, w.dtype, at_s);
                    for (int i = 0; i < tile; ++i) {
                        acc[i][b] = fold_group(acc[i][b], hi[i][b], lo[i][b], sg, og, a->d[(m0 + i) * groups + g],
                                               a->sum16[(m0 + i) * 2 * groups + half], a->base);
                        hi[i][b] = lo[i][b] = _mm512_setzero_si512();
                    }
                }
            }
        }
        if (halves) continue;
        for (int b = 0; b < blocks; ++b) {
            const int64_t at = base + b * scales_apart + g * BLOCK;
            const __m512 sg = load16(w.s, w.dtype, at), og = load16(w.o, w.dtype, at);
            for (int i = 0; i < tile; ++i)
                acc[i][b] = fold_group(acc[i][b], hi[i][b], lo[i][b], sg, og, a->d[(m0 + i) * groups + g],
                                       a->sum[(m0 + i) * groups + g], a->base);
        }
    }
    for (int i = 0; i < tile; ++i)
        for (int b = 0; b < blocks; ++b) _mm512_storeu_ps(out[i] + b * BLOCK, acc[i][b]);
}
#elif defined(__AVX2__)
#if EXACT_TILES
#error "the AVX2 loop folds 127 hi + lo (ACTS_BASE)"
#endif
static inline __m256 fold_group(__m256 acc, __m256i hi, __m256i lo, __m256 s, __m256 o, float d, float sum) {
    __m256i dot = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 7), hi), lo);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(d)), acc);
    return _mm256_fmadd_ps(o, _mm256_set1_ps(sum), acc);
}

/* 8 scales (or offsets) from element `index` */
static inline __m256 load8_scales(const void *p, int dtype, int64_t index) {
    if (dtype == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + index)));
    if (dtype == DT_S8_32 || dtype == DT_S8_16) { /* index is a group's row 0 or 8 (8 | index) */
        const int8_t *codes;
        const float *units = (const float *)factored_super(p, dtype, index, &codes);
        const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + (index & 15)))));
        return _mm256_mul_ps(values, _mm256_loadu_ps(units + (index & 15)));
    }
    return _mm256_loadu_ps((const float *)p + index);
}

/* 8 rows' dots of 4 inputs with centred 8-bit codes c = q - 128 (s8): |c| (u8, <= 128) times x with c's
 * sign, so that vpmaddubsw's int16 pairs cannot saturate (128 * 127 * 2 < 32768) */
static inline __m256i centred_dot4(__m256i magnitude, __m256i centred, int32_t x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x), centred)),
                             _mm256_set1_epi16(1));
}

/* Half h (rows 8h..8h+7) of a block. 4-bit codes fit vpmaddubsw's int16 pairs (15 * 127 * 2) as they
 * are (and 8 steps of them in int16, widened once a group). 8-bit codes times the second step's codes
 * (|q2| <= 64) fit as they are too (255 * 64 * 2); times the first step's they are centred (q - 128),
 * and 128 times those codes' sum is added back. */
static inline __attribute__((always_inline)) void half_dots(const uint8_t *block, int bits, scales_t w, int64_t base,
                                                             const acts_t *a, int64_t m0, int tile, int h,
                                                             float out[][BLOCK], const int halves) {
    const int64_t kp = a->kp, groups = a->groups;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256 acc[TILE];
    for (int i = 0; i < tile; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256i hi[TILE], lo[TILE];
        for (int i = 0; i < tile; ++i) hi[i] = lo[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const int64_t at = g * GROUP + 4 * j;
            if (bits == 4) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(block + ((g / 2) * 8 + j) * STEP_BYTES + h * 32));
                __m256i w = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
                for (int i = 0; i < tile; ++i) { /* int16 pair sums: 8 steps of 2 * 15 * 127 fit */
                    hi[i] = _mm256_add_epi16(hi[i], _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4(a->q1, kp, m0 + i, at))));
                    lo[i] = _mm256_add_epi16(lo[i], _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4(a->q2, kp, m0 + i, at))));
                }
            } else {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(block + (g * 8 + j) * STEP_BYTES + h * 32));
                __m256i centred = _mm256_xor_si256(raw, _mm256_set1_epi8((char)0x80)), magnitude = _mm256_abs_epi8(centred);
                for (int i = 0; i < tile; ++i) {
                    hi[i] = _mm256_add_epi32(hi[i], centred_dot4(magnitude, centred, x4(a->q1, kp, m0 + i, at)));
                    lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(_mm256_maddubs_epi16(raw, _mm256_set1_epi32(
                                                     x4(a->q2, kp, m0 + i, at))), _mm256_set1_epi16(1)));
                }
                if (halves && (j == 3 || j == 7)) { /* a half group folded with its own scale and offset */
                    const int64_t half = 2 * g + j / 4, at_s = base + half * BLOCK + h * 8;
                    const __m256 sg = load8_scales(w.s, w.dtype, at_s), og = load8_scales(w.o, w.dtype, at_s);
                    for (int i = 0; i < tile; ++i) {
                        const __m256i whole = _mm256_add_epi32(
                            lo[i], _mm256_set1_epi32(128 * a->csum16[(m0 + i) * 2 * groups + half]));
                        acc[i] = fold_group(acc[i], hi[i], whole, sg, og, a->d[(m0 + i) * groups + g],
                                            a->sum16[(m0 + i) * 2 * groups + half]);
                        hi[i] = lo[i] = _mm256_setzero_si256();
                    }
                }
            }
        }
        if (halves) continue;
        if (bits == 4) /* the group's int16 pair sums to int32 per row, once */
            for (int i = 0; i < tile; ++i) {
                hi[i] = _mm256_madd_epi16(hi[i], _mm256_set1_epi16(1));
                lo[i] = _mm256_madd_epi16(lo[i], _mm256_set1_epi16(1));
            }
        else /* 127 hi gains 128 * 127 sum(q1) (csum) */
            for (int i = 0; i < tile; ++i)
                lo[i] = _mm256_add_epi32(lo[i], _mm256_set1_epi32(128 * a->csum[(m0 + i) * groups + g]));
        const int64_t at = base + g * BLOCK + h * 8;
        const __m256 sg = load8_scales(w.s, w.dtype, at), og = load8_scales(w.o, w.dtype, at);
        for (int i = 0; i < tile; ++i)
            acc[i] = fold_group(acc[i], hi[i], lo[i], sg, og, a->d[(m0 + i) * groups + g], a->sum[(m0 + i) * groups + g]);
    }
    for (int i = 0; i < tile; ++i) _mm256_storeu_ps(out[i] + h * 8, acc[i]);
}

static inline __attribute__((always_inline)) void block_dots_simd(const uint8_t *block, int bits, scales_t w,
                                                                   int64_t base, const acts_t *a, int64_t m0,
                                                                   int tile, float out[][BLOCK], const int halves) {
    half_dots(block, bits, w, base, a, m0, tile, 0, out, halves);
    half_dots(block, bits, w, base, a, m0, tile, 1, out, halves);
}
#else
#define block_dots_simd(block, bits, w, base, a, m0, tile, out, halves) \
    block_dots_generic(block, bits, w, halves, base, a, m0, tile, out)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* the activations as bfloat16 rows of Kp (zero beyond K), Mp rows (zero beyond M) */
static uint16_t *bf16_acts(const void *x, int dtype, int64_t m, int64_t k, int64_t kp, int64_t mp) {
    uint16_t *a = aligned_alloc(64, (size_t)(mp * kp) * 2);
    if (!a) return NULL;
#pragma omp parallel for schedule(static) if (core_team(m * k > PARALLEL_MIN_WORK))
    for (int64_t row = 0; row < mp; ++row) {
        uint16_t *out = a + row * kp;
        int64_t col = 0;
        if (row < m) {
            if (dtype == DT_BF16) {
                memcpy(out, (const uint16_t *)x + row * k, (size_t)k * 2);
                col = k;
            } else {
                const float *in = (const float *)x + row * k;
                for (; col + 16 <= k; col += 16)
                    _mm256_storeu_si256((__m256i *)(out + col), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + col)));
                for (; col < k; ++col) out[col] = f32_to_bf16(in[col]);
            }
        }
        memset(out + col, 0, (size_t)(kp - col) * 2);
    }
    return a;
}

/* The vector prompt loop (AVX512-BF16 CPUs, the AMX tile loop's place where there are no tiles: Zen 4 and later
 * EPYCs): the codes dequantized a few blocks at a time to bfloat16 weights (w = q * s + o in float32, rounded
 * once, as the tile loop does) in half_linear.c's block layout, and multiplied as a bfloat16 weight is there
 * (`vdpbf16ps`, float32 sums over all of K in order) with the activations rounded to bfloat16. Not the VNNI loop's
 * arithmetic, so which rows come here is a property of the token that owns a row (native/tile_rows.py: a prompt
 * token's rows); within the loop a row's result does not depend on the other rows of the call. No per-group fold
 * and one bfloat16 product a weight and row where the VNNI loop has two int8 ones: on a 2-core Zen 4 EPYC the
 * default model's projections at 64-512 rows 1.1-1.5x faster than the VNNI loop (a prefill chunk), slower at a
 * few rows (each block dequantized for them: 0.7-0.95x at 16). Each thread takes a contiguous share of (blocks, rows) units in
 * block order, so that it dequantizes each group of blocks once a call. */
#define PROMPT_UNIT_ROWS 32 /* activation rows of a unit: units enough to share a prompt of 128 rows evenly */

/* one block's codes (its scales and offsets from element `at`) as bfloat16 weights in half_linear.c's layout
 * ([Kp/2][16][2]: pair P of row r holds inputs 2P and 2P + 1) */
static void dequantize_block_bf16(const uint8_t *codes, int bits, scales_t w, int64_t groups, int64_t at,
                                  uint16_t *out) {
    const __m512i low_byte = _mm512_set1_epi32(0xff);
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 s = load16(w.s, w.dtype, at + g * BLOCK), o = load16(w.o, w.dtype, at + g * BLOCK);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) { /* step j: inputs 4j .. 4j + 3 of the group, a byte each in each row's lane */
            const __m512i step = step_codes(codes, bits, g, j);
            __m512i weights[4];
            for (int t = 0; t < 4; ++t) {
                const __m512i q = _mm512_and_si512(_mm512_srli_epi32(step, 8 * t), low_byte);
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, o);
                weights[t] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
            }
            for (int p = 0; p < 2; ++p)
                _mm512_store_si512((void *)(out + (g * 16 + 2 * j + p) * 2 * BLOCK),
                                   _mm512_or_si512(weights[2 * p], _mm512_slli_epi32(weights[2 * p + 1], 16)));
        }
    }
}

typedef struct {
    const uint16_t *acts;
    uint16_t *weights; /* each thread's dequantized blocks, HALF_TILE_BLOCKS x Kp x 16 a thread */
    int64_t m, n, kp;
    const uint8_t *codes;
    int bits;
    scales_t w;
    const float *bias;
    void *y;
    int y_dtype, gated;
} prompt_call;

/* A unit's blocks: `together` blocks from block b, or gated, `together` gate blocks from b and as many up blocks
 * from b + `up` (the product's second half) after them */
static void prompt_unit_weights(const prompt_call *c, int64_t b, int together, int64_t up, uint16_t *weights) {
    const int64_t groups = c->kp / GROUP, block_bytes = (c->bits == 4 ? c->kp / 2 : c->kp) * BLOCK;
    for (int slot = 0; slot < (c->gated ? 2 : 1) * together; ++slot) {
        const int64_t block = slot < together ? b + slot : b + up + slot - together;
        dequantize_block_bf16(c->codes + block * block_bytes, c->bits, c->w, groups, block * groups * BLOCK,
                              weights + slot * c->kp * BLOCK);
    }
}

static void prompt_work(void *context, int64_t thread, int64_t threads) {
    const prompt_call *c = context;
    const int64_t per_set = c->gated ? HALF_TILE_BLOCKS / 2 : HALF_TILE_BLOCKS; /* gated: as many up blocks again */
    const int64_t outputs = c->gated ? c->n / 2 : c->n; /* gated: the gate's, whose blocks are the sets' first */
    const int64_t blocks = (outputs + BLOCK - 1) / BLOCK, sets = (blocks + per_set - 1) / per_set;
    const int64_t chunks = (c->m + PROMPT_UNIT_ROWS - 1) / PROMPT_UNIT_ROWS;
    uint16_t *weights = c->weights + thread * HALF_TILE_BLOCKS * c->kp * BLOCK;
    int64_t u0, u1, have = -1;
    team_share(sets * chunks, thread, threads, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t set = u / chunks, b = set * per_set, m0 = u % chunks * PROMPT_UNIT_ROWS;
        const int together = blocks - b < per_set ? (int)(blocks - b) : (int)per_set;
        if (set != have) {
            prompt_unit_weights(c, b, together, blocks, weights);
            have = set;
        }
        const int64_t m1 = m0 + PROMPT_UNIT_ROWS < c->m ? m0 + PROMPT_UNIT_ROWS : c->m;
        core_half_bf16_blocks(weights, (c->gated ? 2 : 1) * together, c->acts, c->kp, m0, m1, b * BLOCK, c->n, c->bias,
                              c->y, c->y_dtype, c->gated);
    }
}

/* y = x @ W^T + bias by the vector prompt loop; `gated` (n / 2 a multiple of 16): y [m, n / 2] = silu(gate) * up of
 * the two halves of that product instead (gate block b and up block n / 32 + b multiplied together) */
static int packed_linear_prompt(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                                int64_t n, int64_t kp, scales_t w, const float *bias, void *y, int y_dtype, int gated) {
    /* the threads' blocks allocated here, on the calling thread, as the VNNI loop's activations are, not by each
       thread: what a worker thread frees stays in its own malloc arena (benchmarks/soak.py --rounds 8 on the Zen 4:
       one round's RSS 14% over the first's with per-thread buffers, at most 7% with these; one run each) */
    uint16_t *acts = bf16_acts(x, x_dtype, m, k, kp, m);
    uint16_t *weights = aligned_alloc(64, (size_t)(omp_get_max_threads() * HALF_TILE_BLOCKS * kp * BLOCK) * 2);
    if (!acts || !weights) {
        free(acts);
        free(weights);
        return ERR_MEMORY;
    }
    prompt_call call = {acts, weights, m, n, kp, codes, bits, w, bias, y, y_dtype, gated};
    run_team(1, prompt_work, &call);
    free(weights);
    free(acts);
    return OK;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The AMX loop (Sapphire Rapids and later Xeons): each block's codes dequantized, a group at a time, to
 * bfloat16 weights (w = q * s + o in float32, rounded once) in the tiles' pair layout, the activations
 * rounded to bfloat16, and `tdpbf16ps` summing 16 activation rows x 16 weight rows x 32 inputs into
 * float32 tiles that hold a row's sum over all of K: nothing leaves the tiles before the end of the row,
 * where the VNNI loop's int32 dots must be folded with each group's scales. Not the VNNI loop's
 * arithmetic (bfloat16 products instead of exact integer dots of two int8 steps), so which rows come here
 * is a property of the token that owns a row, never of the batch (native/tile_rows.py: a prompt token's
 * rows); within this loop a row's result does not depend on the other rows of the call (a row is always
 * the same sequence of tile products over K in order). Several times slower than the VNNI loop at one row
 * (the weights dequantized for a single row), 2-2.6x faster from 64 rows on. */
#include <sys/syscall.h>
#include <unistd.h>

/* bfloat16 activation rows that the threads' blocks pass over at a time (each thread dequantizes its blocks once
 * a chunk): 1 MB, so that a 1536-input weight's chunk is 320 rows, not 512 KB's 160 (the down projection at
 * 1024 / 2048 rows 10-13% faster on the 2-core Xeon, the 576-input shapes within 3%; 1.5 MB slower) */
#define AMX_ACTS_BYTES (1024 * 1024)

static int amx_state; /* 0: not asked yet; 1: granted; -1: refused (the VNNI loop runs) */

/* Linux hands a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, 5.16+). */
static int amx_granted(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (!state) {
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) ? -1 : 1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* Byte shuffles that put a step's codes (16 weight rows x 4 inputs, a byte each) into int32 lanes: pick[h][p]
 * takes, to lane l, the code of weight row 8h + l / 2 at input 2p + l % 2 (made once a call, per thread). */
typedef struct {
    __m512i pick[2][2];
} amx_picks_t;

static amx_picks_t amx_picks(void) {
    amx_picks_t picks;
    for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 2; ++p) {
            int8_t index[64];
            for (int byte = 0; byte < 64; ++byte) /* only each lane's first byte is kept (first_byte below) */
                index[byte] = (int8_t)(4 * (8 * h + byte / 8) + 2 * p + (byte / 4) % 2);
            picks.pick[h][p] = _mm512_loadu_si512((const void *)index);
        }
    return picks;
}

/* Group g of one block as a B tile: 16 input pairs x 16 weight rows x 2 bfloat16 (row 2j + p holds inputs
 * 4j + 2p and 4j + 2p + 1 of the group for each weight row). */
/* A group's 16 scales and offsets (from element `at`) as each half of a pair row needs them: lane l of half h
 * the weight row 8h + l / 2's */
typedef struct {
    __m512 s[2], o[2];
} amx_group_scales_t;

static inline __attribute__((always_inline)) amx_group_scales_t amx_group_scales(scales_t w, int64_t at) {
    const __m512 s = load16(w.s, w.dtype, at), o = load16(w.o, w.dtype, at);
    const __m512i first_rows = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i last_rows = _mm512_add_epi32(first_rows, _mm512_set1_epi32(8));
    return (amx_group_scales_t){{_mm512_permutexvar_ps(first_rows, s), _mm512_permutexvar_ps(last_rows, s)},
                                {_mm512_permutexvar_ps(first_rows, o), _mm512_permutexvar_ps(last_rows, o)}};
}

/* Pair row 2j + p of a group's B tile from its step j's codes: for each of the 16 weight rows (a 32-bit lane
 * each) the bfloat16 weights of inputs 4j + 2p and 4j + 2p + 1 (w = q * s + o in float32, rounded once) */
static inline __attribute__((always_inline)) __m512i amx_pair_row(__m512i codes, int p, const amx_picks_t *picks,
                                                                   const amx_group_scales_t *scales) {
    const __mmask64 first_byte = 0x1111111111111111ull;
    __m512 half[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_maskz_permutexvar_epi8(first_byte, picks->pick[h][p], codes);
        half[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scales->s[h], scales->o[h]);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(half[1], half[0]);
}

static inline __attribute__((always_inline)) void amx_dequantize_group(const uint8_t *block, int bits, scales_t w,
                                                                        int64_t at, int64_t g,
                                                                        const amx_picks_t *picks, uint16_t *tile) {
    const amx_group_scales_t scales = amx_group_scales(w, at);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        const __m512i codes = step_codes(block, bits, g, j);
        for (int p = 0; p < 2; ++p)
            _mm512_store_si512((void *)(tile + (2 * j + p) * 32), amx_pair_row(codes, p, picks, &scales));
    }
}

/* Float32 outputs of a call of at least this many bytes leave the tile loop by streaming stores: they pass the
 * caches (more than a core's 2 MB L2: the next kernel reads them back from memory either way) and so need no
 * read of each line before it is written. A prefill chunk of 2048 tokens on the 2-core Xeon: the gated gate/up
 * call ~11% faster, q/k/v and o 3-9%, the whole prefill 0.535 -> 0.50 s (benchmarks/step_kernels.py --prompts
 * 16, four alternations); a one-prompt prefill (128 rows) stays under the line and keeps ordinary stores. */
#define AMX_STREAM_BYTES (2 * 1024 * 1024)

/* 16 float32 outputs into y at `at`: by a streaming store where `stream` and the 64 bytes are one aligned line */
static inline void amx_store16(float *at, __m512 v, int stream) {
    if (stream && !((uintptr_t)at & 63))
        _mm512_stream_ps(at, v);
    else
        _mm512_storeu_ps(at, v);
}

/* rows [row, row + rows) of a float32 tile's 16 x 16 sums (plus bias) into y's columns [col0, col0 + cols) */
static inline void amx_store(const float sums[AMX_ROWS][BLOCK], int64_t row, int64_t rows, int64_t col0,
                             int64_t cols, const float *bias, void *y, int y_dtype, int64_t n, int stream) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + col0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums[i]), b);
        if (y_dtype == DT_BF16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (row + i) * n + col0, keep, (__m256i)_mm512_cvtneps_pbh(v));
        else if (cols == BLOCK)
            amx_store16((float *)y + (row + i) * n + col0, v, stream);
        else
            _mm512_mask_storeu_ps((float *)y + (row + i) * n + col0, keep, v);
    }
}

/* rows [row, row + rows) of silu(gate) * up into y's columns [col0, col0 + 16) (y: [m, n / 2]), from the float32
 * sums of the gate block at col0 and of the up block at n / 2 + col0 (plus their biases): the bits that
 * amx_store of both and then cpu_ops.c's silu * up of them give (each rounded to y's dtype first) */
static inline void amx_store_gated(const float gate_sums[AMX_ROWS][BLOCK], const float up_sums[AMX_ROWS][BLOCK],
                                   int64_t row, int64_t rows, int64_t col0, const float *bias, void *y, int y_dtype,
                                   int64_t n, int stream) {
    const int64_t half = n / 2;
    const __m512 gate_bias = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps(),
                 up_bias = bias ? _mm512_loadu_ps(bias + half + col0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
        float gate[BLOCK], up[BLOCK];
        __m512 g = _mm512_add_ps(_mm512_loadu_ps(gate_sums[i]), gate_bias),
               u = _mm512_add_ps(_mm512_loadu_ps(up_sums[i]), up_bias);
        if (y_dtype == DT_BF16) { /* as amx_store rounds them */
            g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(g)), 16));
            u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(u)), 16));
        }
        _mm512_storeu_ps(gate, g);
        _mm512_storeu_ps(up, u);
        silu_times(gate, up, BLOCK, y_dtype);
        if (y_dtype == DT_F32)
            amx_store16((float *)y + (row + i) * half + col0, _mm512_loadu_ps(gate), stream);
        else
            store_row(y, y_dtype, (row + i) * half + col0, BLOCK, gate);
    }
}

/* Outputs of `blocks` (1 or 2) weight blocks whose B tiles are in `tiles` ([blocks][G][16 x 32]) for the
 * activation rows [m0, m1): two row tiles at a time (four float32 tiles of sums), each over all groups.
 * `gated`: the two blocks are a gate block (at col0) and its up block, and y takes silu(gate) * up. */
static void amx_block_outputs(const uint16_t *tiles, int blocks, int64_t groups, const uint16_t *acts,
                              int64_t kp, int64_t m0, int64_t m1, int64_t m, int64_t col0, int64_t n,
                              const float *bias, void *y, int y_dtype, int gated, int stream) {
    const int64_t tile_elements = 16 * 32, stride = kp * 2;
    const uint16_t *second = tiles + groups * tile_elements;
    float sums[2][AMX_ROWS][BLOCK] __attribute__((aligned(64)));
    for (int64_t row = m0; row < m1; row += 2 * AMX_ROWS) {
        const int two_rows = m1 - row > AMX_ROWS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < groups; ++g) {
            _tile_loadd(4, acts + row * kp + g * 32, stride);
            _tile_loadd(6, tiles + g * tile_elements, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (blocks == 2) {
                _tile_loadd(7, second + g * tile_elements, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_rows) {
                _tile_loadd(5, acts + (row + AMX_ROWS) * kp + g * 32, stride);
                _tile_dpbf16ps(2, 5, 6);
                if (blocks == 2) _tile_dpbf16ps(3, 5, 7);
            }
        }
        for (int half = 0; half <= two_rows; ++half) {
            const int64_t first = row + half * AMX_ROWS, rows = m - first < AMX_ROWS ? m - first : AMX_ROWS;
            if (rows <= 0) continue;
            if (half == 0) _tile_stored(0, sums[0], 64);
            if (half == 1) _tile_stored(2, sums[0], 64);
            if (blocks == 2 && half == 0) _tile_stored(1, sums[1], 64);
            if (blocks == 2 && half == 1) _tile_stored(3, sums[1], 64);
            if (gated) {
                amx_store_gated((const float (*)[BLOCK])sums[0], (const float (*)[BLOCK])sums[1], first, rows, col0,
                                bias, y, y_dtype, n, stream);
                continue;
            }
            for (int b = 0; b < blocks; ++b) {
                const int64_t c0 = col0 + b * BLOCK;
                if (c0 < n)
                    amx_store((const float (*)[BLOCK])sums[b], first, rows, c0, n - c0 < BLOCK ? n - c0 : BLOCK, bias,
                              y, y_dtype, n, stream);
            }
        }
    }
}

/* The tile loop's vector twin: the tiles' bits for a call of at most TWIN_ROWS rows, where the tile loop's time
 * is dequantizing every weight block into a tile for a row or two. Each block's pair rows are dequantized as the
 * tile loop does (amx_pair_row) but stay in registers, split into their first and second elements as float32,
 * and multiplied by FMAs with FTZ and DAZ set: `tdpbf16ps` sums a tile product (16 pairs of inputs) as two
 * float32 chains from zero, one over the pairs' first elements and one over their second, each product (exact
 * in float32) rounded once into its chain, denormals flushed, and then C + (first + second) (DESIGN.md, the AMX
 * tile loop). On the 2-core Xeon (benchmarks/packed_kernels.py, 2 threads) 3072 x 576 4-bit at 1 / 2 rows
 * 75-78 / 81-90 us against the tile loop's ~100 at any number of rows up to 16 (the VNNI loop: 27 / 38); the
 * 8-bit LM head at 1 / 2 rows 1.11 / 1.27 ms against 1.37 (VNNI 0.64). `vdpbf16ps` with one element of each activation pair zeroed
 * gives the same bits, but cost ~1.8 cycles a row and pair row against the FMAs' ~0.5 here. */
#define TWIN_ROWS 2 /* at 3 rows the twin is about as fast as the tiles (3072 x 576: ~100 us either way) */

static int tile_twin_allowed = 1; /* core_packed_tile_twin */

/* The sums [b][row][16] of `together` (1 or 2) weight blocks (codes at block[b], scales from at[b]) for `rows`
 * activation rows (`acts`: kp a row, bfloat16 values as float32). */
static inline __attribute__((always_inline)) void twin_block_sums(const uint8_t *const block[2], const int64_t at[2],
                                                                   const int together, int bits, scales_t w,
                                                                   int64_t groups, const float *acts, int64_t kp,
                                                                   const int rows, const amx_picks_t *picks,
                                                                   float sums[2][AMX_ROWS][BLOCK]) {
    for (int b = 0; b < together; ++b)
        for (int r = 0; r < rows; ++r) _mm512_store_ps(sums[b][r], _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; ++g) {
        amx_group_scales_t scales[2];
        __m512 first[TWIN_ROWS][2], second[TWIN_ROWS][2];
        for (int b = 0; b < together; ++b) {
            scales[b] = amx_group_scales(w, at[b] + g * BLOCK);
            for (int r = 0; r < rows; ++r) first[r][b] = second[r][b] = _mm512_setzero_ps();
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i codes[2];
            for (int b = 0; b < together; ++b) codes[b] = step_codes(block[b], bits, g, j);
            for (int p = 0; p < 2; ++p) {
                __m512i pair[2];
                for (int b = 0; b < together; ++b) pair[b] = amx_pair_row(codes[b], p, picks, &scales[b]);
                __m512 firsts[2], seconds[2]; /* the pair's weights as float32 (bfloat16 values) */
                for (int b = 0; b < together; ++b) {
                    firsts[b] = _mm512_castsi512_ps(_mm512_slli_epi32(pair[b], 16));
                    seconds[b] = _mm512_castsi512_ps(_mm512_and_si512(pair[b], _mm512_set1_epi32((int)0xffff0000u)));
                }
                for (int r = 0; r < rows; ++r) {
                    const float *act = acts + r * kp + g * GROUP + 4 * j + 2 * p;
                    const __m512 one = _mm512_set1_ps(act[0]), other = _mm512_set1_ps(act[1]);
                    for (int b = 0; b < together; ++b) {
                        first[r][b] = _mm512_fmadd_ps(one, firsts[b], first[r][b]);
                        second[r][b] = _mm512_fmadd_ps(other, seconds[b], second[r][b]);
                    }
                }
            }
        }
        for (int b = 0; b < together; ++b)
            for (int r = 0; r < rows; ++r)
                _mm512_store_ps(sums[b][r],
                                _mm512_add_ps(_mm512_load_ps(sums[b][r]), _mm512_add_ps(first[r][b], second[r][b])));
    }
}

typedef struct {
    const uint8_t *codes;
    int bits;
    int64_t n, kp, groups, block_bytes;
    scales_t w;
    const float *acts;
    int64_t m;
    const float *bias;
    void *y;
    int y_dtype, gated;
} twin_call;

/* twin_block_sums with the rows and blocks as constants (so that the chains stay in registers) */
static void twin_sums(const twin_call *c, const uint8_t *const block[2], const int64_t at[2], int together,
                      const amx_picks_t *picks, float sums[2][AMX_ROWS][BLOCK]) {
#define SUMS(R, B) twin_block_sums(block, at, B, c->bits, c->w, c->groups, c->acts, c->kp, R, picks, sums)
    const int two = together == 2;
    switch (c->m) {
    case 1: two ? SUMS(1, 2) : SUMS(1, 1); break;
    default: two ? SUMS(2, 2) : SUMS(2, 1); break;
    }
#undef SUMS
}

static void twin_work(void *context, int64_t thread, int64_t threads) {
    const twin_call *c = context;
    const amx_picks_t picks = amx_picks();
    const unsigned int csr = _mm_getcsr();
    const int64_t blocks = (c->n + BLOCK - 1) / BLOCK, units = c->gated ? blocks / 2 : blocks;
    int64_t b0, b1;
    team_share(units, thread, threads, &b0, &b1);
    float sums[2][AMX_ROWS][BLOCK] __attribute__((aligned(64)));
    for (int64_t b = b0; b < b1; b += c->gated ? 1 : 2) {
        const int together = c->gated || b1 - b >= 2 ? 2 : 1;
        const int64_t second = c->gated ? b + units : b + 1;
        const uint8_t *const block[2] = {c->codes + b * c->block_bytes, c->codes + second * c->block_bytes};
        const int64_t at[2] = {b * c->groups * BLOCK, second * c->groups * BLOCK};
        _mm_setcsr(csr | 0x8040); /* FTZ and DAZ, as the tiles multiply and sum (not for the stores' epilogue) */
        twin_sums(c, block, at, together, &picks, sums);
        _mm_setcsr(csr);
        if (c->gated) {
            amx_store_gated((const float (*)[BLOCK])sums[0], (const float (*)[BLOCK])sums[1], 0, c->m, b * BLOCK,
                            c->bias, c->y, c->y_dtype, c->n, 0);
            continue;
        }
        for (int bb = 0; bb < together; ++bb) {
            const int64_t c0 = (b + bb) * BLOCK;
            amx_store((const float (*)[BLOCK])sums[bb], 0, c->m, c0, c->n - c0 < BLOCK ? c->n - c0 : BLOCK, c->bias,
                      c->y, c->y_dtype, c->n, 0);
        }
    }
}

/* packed_linear_amx's results for m <= TWIN_ROWS rows, on vectors */
static int packed_linear_twin(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                              int64_t n, int64_t kp, scales_t w, const float *bias, void *y, int y_dtype, int gated) {
    uint16_t *rounded = bf16_acts(x, x_dtype, m, k, kp, m);
    float *acts = aligned_alloc(64, (size_t)(m * kp) * 4);
    if (!rounded || !acts) {
        free(rounded);
        free(acts);
        return ERR_MEMORY;
    }
    for (int64_t i = 0; i < m * kp; ++i) acts[i] = bf16_to_f32(rounded[i]);
    free(rounded);
    twin_call call = {codes, bits, n, kp, kp / GROUP, (bits == 4 ? kp / 2 : kp) * BLOCK, w, acts, m, bias, y,
                      y_dtype, gated};
    run_team(1, twin_work, &call);
    free(acts);
    return OK;
}

/* y = x @ W^T + bias on the tiles; `gated` (n / 2 a multiple of 16): y [m, n / 2] = silu(gate) * up of the two
 * halves of that product instead (gate block b and up block n / 32 + b multiplied together) */
static int packed_linear_amx(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                             int64_t n, int64_t kp, scales_t w, const float *bias, void *y, int y_dtype, int gated) {
    if (m <= TWIN_ROWS && __atomic_load_n(&tile_twin_allowed, __ATOMIC_RELAXED))
        return packed_linear_twin(x, x_dtype, m, k, codes, bits, n, kp, w, bias, y, y_dtype, gated);
    const int64_t mp = (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, groups = kp / GROUP;
    uint16_t *acts = bf16_acts(x, x_dtype, m, k, kp, mp);
    if (!acts) return ERR_MEMORY;
    const int stream = y_dtype == DT_F32 && m * (gated ? n / 2 : n) * 4 >= AMX_STREAM_BYTES;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, block_bytes = (bits == 4 ? kp / 2 : kp) * BLOCK;
    int64_t chunk = AMX_ACTS_BYTES / (2 * kp);
    chunk = chunk < 2 * AMX_ROWS ? 2 * AMX_ROWS : chunk / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    int status = OK;
#pragma omp parallel if (core_team(1))
    {
        uint16_t *tiles = aligned_alloc(64, (size_t)(2 * groups * 16 * 32) * 2);
        if (!tiles) {
#pragma omp atomic write
            status = ERR_MEMORY;
        } else {
            amx_configure();
            const amx_picks_t picks = amx_picks();
            const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t units = gated ? blocks / 2 : blocks; /* gated: a gate block and its up block a unit */
            const int64_t b0 = units * t / threads, b1 = units * (t + 1) / threads, step = gated ? 1 : 2;
            for (int64_t m0 = 0; m0 < m; m0 += chunk) {
                const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
                for (int64_t b = b0; b < b1; b += step) {
                    const int together = gated ? 2 : b1 - b < 2 ? 1 : 2;
                    for (int bb = 0; bb < together; ++bb) {
                        const int64_t block = b + bb * (gated ? units : 1);
                        for (int64_t g = 0; g < groups; ++g)
                            amx_dequantize_group(codes + block * block_bytes, bits, w, block * groups * BLOCK + g * BLOCK,
                                                 g, &picks, tiles + (bb * groups + g) * 16 * 32);
                    }
                    amx_block_outputs(tiles, together, groups, acts, kp, m0, m1, m, b * BLOCK, n, bias, y, y_dtype,
                                      gated, stream);
                }
            }
            if (stream) _mm_sfence(); /* the streamed outputs visible before the region's end */
            _tile_release();
            free(tiles);
        }
    }
    free(acts);
    return status;
}
#endif

/* out rows [m0, m0 + rows) (plus bias) into y's columns [col0, col0 + cols), a row at a time (store_row's
 * vector loop; bfloat16 rounded by f32_to_bf16 as one element at a time was) */
static inline void store_outputs(float out[][TILE_BLOCKS * BLOCK], int64_t m0, int rows, int64_t col0, int64_t cols,
                                 const float *bias, void *y, int y_dtype, int64_t n) {
    for (int i = 0; i < rows; ++i) {
        float row[TILE_BLOCKS * BLOCK];
        for (int64_t c = 0; c < cols; ++c) row[c] = out[i][c] + (bias ? bias[col0 + c] : 0.f);
        store_row(y, y_dtype, (m0 + i) * n + col0, cols, row);
    }
}

#if EXACT_TILES
#define GROUP_TILE_BYTES (8 * STEP_BYTES) /* a group of one block as a B tile: 8 steps x 16 rows x 4 codes */
#define FUSED_TILE_BYTES (2 * GROUP_TILE_BYTES) /* the same twice, 16 times the codes and the codes */

/* The VNNI loop's arithmetic on the AMX tiles (amx_configure_int8), for 16 activation rows from m0 and one
 * weight block: a group's two integer dots (its codes times q1, times q2) as `tdpbsud` products of the rows'
 * codes (signed: an A tile of 16 rows x 32) by the group's codes (unsigned: the packed layout of a group is
 * a B tile as it is; `codes` holds group g's at g * GROUP_TILE_BYTES), each then folded with the group's
 * scales by fold_group, the instructions of tile_dots in the same order. The integer dots are exact, so
 * every output has tile_dots's bits. Group g + 1's products are asked for before group g's sums leave the
 * tiles (sums in tiles 0-1 and 2-3 by turns, the codes in 6 and 7), though the two barely overlap: a tile
 * store slows the fold's loads (docs/DESIGN.md). */
static inline __attribute__((always_inline)) void exact_block_dots(const uint8_t *codes, scales_t w, int64_t at,
                                                                    const acts_t *a, int64_t m0,
                                                                    float out[][TILE_BLOCKS * BLOCK], int column) {
    const int64_t kp = a->kp, groups = a->groups;
    const int8_t *q1 = a->q1 + m0 * kp, *q2 = a->q2 + m0 * kp;
    int32_t dots[2][2][EXACT_TILES_ROWS][BLOCK] __attribute__((aligned(64))); /* [turn][q1 / q2][row][weight row] */
    __m512 acc[EXACT_TILES_ROWS];
    for (int i = 0; i < EXACT_TILES_ROWS; ++i) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(g, HI, LO, CODES)                                      \
    do {                                                                \
        _tile_loadd(CODES, codes + (g) * GROUP_TILE_BYTES, STEP_BYTES); \
        _tile_loadd(4, q1 + (g) * GROUP, kp);                           \
        _tile_loadd(5, q2 + (g) * GROUP, kp);                           \
        _tile_zero(HI);                                                 \
        _tile_zero(LO);                                                 \
        _tile_dpbsud(HI, 4, CODES);                                     \
        _tile_dpbsud(LO, 5, CODES);                                     \
    } while (0)
#define FOLD(g, HI, LO, TURN)                                                                                 \
    do {                                                                                                      \
        _tile_stored(HI, dots[TURN][0], 64);                                                                  \
        _tile_stored(LO, dots[TURN][1], 64);                                                                  \
        const __m512 sg = load16(w.s, w.dtype, at + (g) * BLOCK), og = load16(w.o, w.dtype, at + (g) * BLOCK); \
        _Pragma("GCC unroll 16") for (int i = 0; i < EXACT_TILES_ROWS; ++i)                                   \
            acc[i] = fold_group(acc[i], _mm512_load_si512((const void *)dots[TURN][0][i]),                    \
                                _mm512_load_si512((const void *)dots[TURN][1][i]), sg, og,                    \
                                a->d[(m0 + i) * groups + (g)], a->sum[(m0 + i) * groups + (g)], a->base);     \
    } while (0)
    /* group g + 1's products asked for before group g's sums are folded */
    MULTIPLY(0, 0, 1, 6);
    for (int64_t g = 0; g < groups; g += 2) {
        if (g + 1 < groups) MULTIPLY(g + 1, 2, 3, 7);
        FOLD(g, 0, 1, 0);
        if (g + 1 == groups) break;
        if (g + 2 < groups) MULTIPLY(g + 2, 0, 1, 6);
        FOLD(g + 1, 2, 3, 1);
    }
#undef MULTIPLY
#undef FOLD
    for (int i = 0; i < EXACT_TILES_ROWS; ++i) _mm512_storeu_ps(out[i] + column, acc[i]);
}

/* The same for 4-bit codes, a group's two steps in one tile product (all tiles 16 rows x 64 bytes: amx_configure):
 * the rows' codes of group g as [q1 | q2] (an A tile of 16 rows x 64 from a->q12) times the group's fused B tile
 * (`codes`: group g's at g * FUSED_TILE_BYTES, its 8 steps' codes times 16, then its 8 steps' codes), so that one
 * `tdpbsud` of 64 inputs gives 16 sum(q * q1) + sum(q * q2), the dot fold_group makes of the two (ACTS_BASE 16),
 * and fold_dot folds it: one product, one tile store and one int32 dot a group where there were two of each. */
static inline __attribute__((always_inline)) void exact_block_dots_fused(const uint8_t *codes, scales_t w, int64_t at,
                                                                          const acts_t *a, int64_t m0,
                                                                          float out[][TILE_BLOCKS * BLOCK],
                                                                          int column) {
    const int64_t kp = a->kp, groups = a->groups;
    const int8_t *q12 = a->q12 + m0 * 2 * kp;
    int32_t dots[2][EXACT_TILES_ROWS][BLOCK] __attribute__((aligned(64))); /* [turn][row][weight row] */
    __m512 acc[EXACT_TILES_ROWS];
    for (int i = 0; i < EXACT_TILES_ROWS; ++i) acc[i] = _mm512_setzero_ps();
#define MULTIPLY(g, SUMS, CODES, ACTS)                                      \
    do {                                                                    \
        _tile_loadd(CODES, codes + (g) * FUSED_TILE_BYTES, STEP_BYTES);     \
        _tile_loadd(ACTS, q12 + (g) * 2 * GROUP, 2 * kp);                   \
        _tile_zero(SUMS);                                                   \
        _tile_dpbsud(SUMS, ACTS, CODES);                                    \
    } while (0)
#define FOLD(g, SUMS, TURN)                                                                                   \
    do {                                                                                                      \
        _tile_stored(SUMS, dots[TURN], 64);                                                                   \
        const __m512 sg = load16(w.s, w.dtype, at + (g) * BLOCK), og = load16(w.o, w.dtype, at + (g) * BLOCK); \
        _Pragma("GCC unroll 16") for (int i = 0; i < EXACT_TILES_ROWS; ++i)                                   \
            acc[i] = fold_dot(acc[i], _mm512_load_si512((const void *)dots[TURN][i]), sg, og,                 \
                              a->d[(m0 + i) * groups + (g)], a->sum[(m0 + i) * groups + (g)]);                \
    } while (0)
    MULTIPLY(0, 0, 6, 4);
    for (int64_t g = 0; g < groups; g += 2) {
        if (g + 1 < groups) MULTIPLY(g + 1, 1, 7, 5);
        FOLD(g, 0, 0);
        if (g + 1 == groups) break;
        if (g + 2 < groups) MULTIPLY(g + 2, 0, 6, 4);
        FOLD(g + 1, 1, 1);
    }
#undef MULTIPLY
#undef FOLD
    for (int i = 0; i < EXACT_TILES_ROWS; ++i) _mm512_storeu_ps(out[i] + column, acc[i]);
}

/* The outputs of `blocks` blocks from `first` for the activation rows [m0, m0 + 16 * tiles) (into y, plus bias),
 * 16 at a time on the tiles (exact_block_dots); 4-bit codes are unpacked to a byte each once for all of them. */
static __attribute__((noinline)) void exact_tile_outputs(const uint8_t *first, int64_t block_bytes, int blocks, int bits,
                                                         scales_t w, int64_t base, const acts_t *a, int64_t m0,
                                                         int64_t tiles, int64_t col0, int64_t cols, const float *bias,
                                                         void *y, int y_dtype, int64_t n) {
    const int64_t groups = a->groups, unpacked_bytes = groups * FUSED_TILE_BYTES;
    uint8_t unpacked[bits == 4 ? blocks * unpacked_bytes : 1] __attribute__((aligned(64)));
    const uint8_t *codes[TILE_BLOCKS];
    for (int b = 0; b < blocks; ++b) {
        if (bits == 8) {
            codes[b] = first + b * block_bytes;
            continue;
        }
        uint8_t *bytes = unpacked + b * unpacked_bytes;
        for (int64_t g = 0; g < groups; ++g)
            for (int j = 0; j < 8; ++j) {
                const __m512i step = step_codes(first + b * block_bytes, 4, g, j); /* bytes 0-15: 16 x 15 fits */
                _mm512_store_si512((void *)(bytes + g * FUSED_TILE_BYTES + j * STEP_BYTES), _mm512_slli_epi16(step, 4));
                _mm512_store_si512((void *)(bytes + g * FUSED_TILE_BYTES + GROUP_TILE_BYTES + j * STEP_BYTES), step);
            }
        codes[b] = bytes;
    }
    float out[EXACT_TILES_ROWS][TILE_BLOCKS * BLOCK];
    for (int64_t t = 0; t < tiles; ++t, m0 += EXACT_TILES_ROWS) {
        for (int b = 0; b < blocks; ++b)
            if (bits == 4)
                exact_block_dots_fused(codes[b], w, base + b * groups * BLOCK, a, m0, out, b * BLOCK);
            else
                exact_block_dots(codes[b], w, base + b * groups * BLOCK, a, m0, out, b * BLOCK);
        store_outputs(out, m0, EXACT_TILES_ROWS, col0, cols, bias, y, y_dtype, n);
    }
}
#endif

/* The outputs of blocks [b, b + blocks) (blocks <= TILE_BLOCKS) for activation rows [m_begin, m): TILE rows
 * at a time, then 2, then 1 (each count a compile-time constant, so that the SIMD loop keeps its
 * accumulators in registers) */
static inline __attribute__((always_inline)) void outputs_of(const uint8_t *codes, int bits, scales_t w,
                                                              const float *bias, const acts_t *a, int64_t m_begin,
                                                              int64_t m, int64_t b, int blocks, int64_t n, void *y,
                                                              int y_dtype, int reference, int exact_tiles,
                                                              const int halves) {
    const int64_t block_bytes = (bits == 4 ? a->kp / 2 : a->kp) * BLOCK,
                  scales_apart = (halves ? 2 : 1) * a->groups * BLOCK;
    const int64_t col0 = b * BLOCK, cols = n - col0 < blocks * BLOCK ? n - col0 : blocks * BLOCK;
    const uint8_t *first = codes + b * block_bytes;
    const int64_t base = b * scales_apart; /* the first block's first scale */
    float out[TILE][TILE_BLOCKS * BLOCK];
    int64_t m0 = m_begin;
#if EXACT_TILES
    if (exact_tiles && !halves && m - m0 >= EXACT_TILES_ROWS) { /* the same bits as the loops below */
        const int64_t tiles = (m - m0) / EXACT_TILES_ROWS;
        exact_tile_outputs(first, block_bytes, blocks, bits, w, base, a, m0, tiles, col0, cols, bias, y, y_dtype, n);
        m0 += tiles * EXACT_TILES_ROWS;
    }
#else
    (void)exact_tiles;
#endif
    while (m0 < m) {
        const int tile = m - m0 >= TILE ? TILE : (m - m0 >= 2 ? 2 : 1);
        if (reference) {
            for (int bb = 0; bb < blocks; ++bb) /* block bb's outputs in columns 16 bb.. of out's rows */
                block_dots_generic(first + bb * block_bytes, bits, w, halves, base + bb * scales_apart, a, m0, tile,
                                   (float (*)[TILE_BLOCKS * BLOCK])(out[0] + bb * BLOCK));
        } else {
#if TILE_BLOCKS > 1
#define DOTS(T, B, H) tile_dots(first, block_bytes, B, bits, w, base, a, m0, T, out, H)
            if (halves) /* Q6_K's weights: a block at a time (three loops to compile, not six) */
                for (int bb = 0; bb < blocks; ++bb) {
                    float (*part)[TILE_BLOCKS * BLOCK] = (float (*)[TILE_BLOCKS * BLOCK])(out[0] + bb * BLOCK);
                    const uint8_t *block = first + bb * block_bytes;
                    const int64_t at = base + bb * scales_apart;
                    if (tile == TILE)
                        tile_dots(block, block_bytes, 1, bits, w, at, a, m0, TILE, part, 1);
                    else if (tile == 2)
                        tile_dots(block, block_bytes, 1, bits, w, at, a, m0, 2, part, 1);
                    else
                        tile_dots(block, block_bytes, 1, bits, w, at, a, m0, 1, part, 1);
                }
            else if (blocks == TILE_BLOCKS)
                tile == TILE ? DOTS(TILE, TILE_BLOCKS, 0) : (tile == 2 ? DOTS(2, TILE_BLOCKS, 0) : DOTS(1, TILE_BLOCKS, 0));
            else
                tile == TILE ? DOTS(TILE, 1, 0) : (tile == 2 ? DOTS(2, 1, 0) : DOTS(1, 1, 0));
#undef DOTS
#else
            if (tile == TILE)
                block_dots_simd(first, bits, w, base, a, m0, TILE, out, halves);
            else if (tile == 2)
                block_dots_simd(first, bits, w, base, a, m0, 2, out, halves);
            else
                block_dots_simd(first, bits, w, base, a, m0, 1, out, halves);
#endif
        }
        store_outputs(out, m0, tile, col0, cols, bias, y, y_dtype, n);
        m0 += tile;
    }
}

/* outputs_of for a weight of 32-input groups, and (compiled apart, so that the loops above stay as they
 * were) for one of 16-input groups */
static void block_outputs(const uint8_t *codes, int bits, scales_t w, const float *bias, const acts_t *a,
                          int64_t m_begin, int64_t m, int64_t b, int blocks, int64_t n, void *y, int y_dtype,
                          int reference, int exact_tiles) {
    outputs_of(codes, bits, w, bias, a, m_begin, m, b, blocks, n, y, y_dtype, reference, exact_tiles, 0);
}

static void block_outputs_halves(const uint8_t *codes, int bits, scales_t w, const float *bias, const acts_t *a,
                                 int64_t m_begin, int64_t m, int64_t b, int blocks, int64_t n, void *y,
                                 int y_dtype, int reference) {
    outputs_of(codes, bits, w, bias, a, m_begin, m, b, blocks, n, y, y_dtype, reference, 0, 1);
}

static int arguments_valid(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                           int group, int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                           const void *y, int y_dtype) {
    return !((m > 0 && (!x || !y)) || !codes || (bits != 16 && (!scale || !offset)) || m < 0 || k <= 0 || n <= 0 ||
             kp < k || kp % PAIR || (bits != 4 && bits != 8 && bits != 16) ||
             (group != GROUP && (group != GROUP / 2 || bits != 8)) ||
             (x_dtype != DT_F32 && x_dtype != DT_BF16) || (y_dtype != DT_F32 && y_dtype != DT_BF16) ||
             (bits != 16 && scale_dtype != DT_F32 && scale_dtype != DT_F16 &&
              !(scale_dtype == DT_S8_32 && group == GROUP && kp % 256 == 0) &&
              !(scale_dtype == DT_S8_16 && group == GROUP / 2 && kp % 256 == 0)) ||
             (bits == 16 && scale_dtype != DT_BF16 && scale_dtype != DT_F16));
}

typedef struct {
    const void *x;
    int x_dtype;
    int64_t m, k;
    const uint8_t *codes;
    int bits;
    int64_t n;
    scales_t w;
    const float *bias;
    void *y;
    int y_dtype, reference;
    acts_t *a;
    int64_t blocks, chunk, chunks;
    int tile_blocks, halves, exact_tiles;
    int64_t *taken; /* each share's next unit, TAKEN_APART apart */
} linear_team;

static void linear_work(void *context, int64_t thread, int64_t threads) {
    const linear_team *c = context;
    /* the activations quantized by the same team, each thread its share of the rows (one fork a call
       where a region of their own took two) */
    int64_t r0, r1;
    team_share(c->m, thread, threads, &r0, &r1);
    quantize_rows(c->x, c->x_dtype, r0, r1, c->k, c->a, c->reference);
#if EXACT_TILES
    if (c->a->q12) /* each group's q1 and q2 side by side, for the fused exact tiles */
        for (int64_t row = r0; row < r1; ++row)
            for (int64_t g = 0; g < c->a->groups; ++g) {
                int8_t *to = c->a->q12 + (row * c->a->groups + g) * 2 * GROUP;
                memcpy(to, c->a->q1 + row * c->a->kp + g * GROUP, GROUP);
                memcpy(to + GROUP, c->a->q2 + row * c->a->kp + g * GROUP, GROUP);
            }
    if (c->exact_tiles) {
        if (c->bits == 4)
            amx_configure(); /* exact_block_dots_fused: every tile 16 x 64 bytes */
        else
            amx_configure_int8();
    }
#endif
    team_barrier(threads);
    /* each thread its share's units, then what is left of the others' (see SHARE_UNIT_BLOCKS) */
    for (int64_t i = 0; i < threads; ++i) {
        const int64_t owner = (thread + i) % threads, b0 = c->blocks * owner / threads,
                      b1 = c->blocks * (owner + 1) / threads,
                      parts = (b1 - b0 + SHARE_UNIT_BLOCKS - 1) / SHARE_UNIT_BLOCKS;
        for (int64_t unit; (unit = __atomic_fetch_add(c->taken + owner * TAKEN_APART, 1, __ATOMIC_RELAXED)) <
                           c->chunks * parts;) {
            const int64_t m0 = unit / parts * c->chunk, m1 = m0 + c->chunk < c->m ? m0 + c->chunk : c->m,
                          first = b0 + unit % parts * SHARE_UNIT_BLOCKS,
                          last = first + SHARE_UNIT_BLOCKS < b1 ? first + SHARE_UNIT_BLOCKS : b1;
            for (int64_t b = first; b < last; b += c->tile_blocks) {
                const int together = last - b < c->tile_blocks ? (int)(last - b) : c->tile_blocks;
                if (c->halves) /* called, not through a pointer: each keeps its arguments in registers */
                    block_outputs_halves(c->codes, c->bits, c->w, c->bias, c->a, m0, m1, b, together, c->n, c->y,
                                         c->y_dtype, c->reference);
                else
                    block_outputs(c->codes, c->bits, c->w, c->bias, c->a, m0, m1, b, together, c->n, c->y,
                                  c->y_dtype, c->reference, c->exact_tiles);
            }
        }
    }
#if EXACT_TILES
    if (c->exact_tiles) _tile_release();
#endif
}

int core_packed_uses_amx(void);
static int exact_tiles_allowed = 1; /* core_packed_exact_tiles */

/* 1 where the VNNI loop takes the exact tile loop for its calls of 16 rows or more (an AMX build granted the
 * tiles); `allow` 0 / 1 turns it off / on (for benchmarks and tests: the results are the same), -1 asks. */
int core_packed_exact_tiles(int allow) {
    if (allow >= 0) __atomic_store_n(&exact_tiles_allowed, allow, __ATOMIC_RELAXED);
    return EXACT_TILES && __atomic_load_n(&exact_tiles_allowed, __ATOMIC_RELAXED) && core_packed_uses_amx();
}

/* 1 where the tile loop's calls of up to TWIN_ROWS rows take its vector twin (an amx-bf16 build granted the
 * tiles); `allow` 0 / 1 turns it off / on (for benchmarks and tests: the results are the same), -1 asks. */
int core_packed_tile_twin(int allow) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (allow >= 0) __atomic_store_n(&tile_twin_allowed, allow, __ATOMIC_RELAXED);
    return __atomic_load_n(&tile_twin_allowed, __ATOMIC_RELAXED) && core_packed_uses_amx();
#else
    (void)allow;
    return 0;
#endif
}

/* Whether a call of m activation rows takes the exact tile loop (exact_tile_outputs) for each 16 of its rows,
 * the rest the vector loop (the same bits either way): an AMX build granted the tiles, weights of 32-input
 * groups, and at least a tile of rows. */
static int exact_tiles_take(int64_t m, int reference, int halves) {
#if EXACT_TILES
    return !reference && !halves && m >= EXACT_TILES_ROWS && __atomic_load_n(&exact_tiles_allowed, __ATOMIC_RELAXED) &&
           amx_granted();
#else
    (void)m, (void)reference, (void)halves;
    return 0;
#endif
}

static int packed_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                         int group, int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                         const float *bias, void *y, int y_dtype, int reference) {
    if (!arguments_valid(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, y, y_dtype))
        return ERR_ARGS;
    if (bits == 16) /* 16-bit float weights, their dtype in scale_dtype (half_linear.c) */
        return core_half_linear(x, x_dtype, m, k, (const uint16_t *)codes, scale_dtype, n, kp, bias, y, y_dtype,
                                reference);
    const scales_t w = {scale, offset, scale_dtype};
    const int halves = group != GROUP;
    if (m == 0) return OK;
    acts_t a;
    int status = alloc_acts(m, kp, halves, ACTS_BASE(bits), &a);
    if (status == OK) {
        const int64_t blocks = (n + BLOCK - 1) / BLOCK;
        /* each thread its contiguous share of the blocks (as schedule(static)), over the rows a chunk at a
           time, so that the chunk's activation codes stay in cache while the share's blocks pass over them
           (each output is computed as before: the results do not change) */
        const int exact_tiles = exact_tiles_take(m, reference, halves);
        if (exact_tiles && bits == 4 && !(a.q12 = malloc((size_t)(2 * m * kp)))) {
            free_acts(&a);
            return ERR_MEMORY;
        }
        const int64_t rows_together = exact_tiles ? EXACT_TILES_ROWS : TILE;
        int64_t chunk = ACTS_CHUNK_BYTES / (2 * kp);
        chunk = chunk < rows_together ? rows_together : chunk / rows_together * rows_together;
        /* 8-bit codes on the exact tiles: a tile of rows a unit, whose activation codes stay in L1 while the
           unit's blocks pass (the 8-bit LM head, 49152 x 576, at 64 / 128 rows 7.6 / 17.4 ms -> 6.0 / 12.8 on
           the 2-core Xeon; 8-bit layers no slower). Not for 4-bit codes, unpacked once a unit. */
        if (exact_tiles && bits == 8) chunk = EXACT_TILES_ROWS;
        /* blocks a tile: two where the multiply-adds bound the call; with few rows (a decode step of up
           to 15 sequences) the weight streams from memory, and one block after the other reads it faster
           (the 8-bit LM head, 28 MB: at 1 / 4 / 8 rows 0.74 / 1.8 / 2.4 ms, against 1.0 / 3.0 / 3.1 ms two
           at a time; at 16 rows 5.0 against 4.5 ms). On one thread of a team (decoder_stack.c's row groups:
           a few rows of a layer whose weights the other groups have just brought into the cache) two. */
        const int64_t most = omp_get_max_threads();
        int64_t *taken = calloc((size_t)(most * TAKEN_APART), sizeof(int64_t)); /* each share's next unit */
        if (!taken) {
            free_acts(&a);
            return ERR_MEMORY;
        }
        linear_team ctx = {x, x_dtype, m, k, codes, bits, n, w, bias, y, y_dtype, reference, &a, blocks, chunk,
                           (m + chunk - 1) / chunk, m >= TWO_BLOCK_ROWS || omp_in_parallel() ? TILE_BLOCKS : 1,
                           halves, exact_tiles, taken};
        run_team(1, linear_work, &ctx);
        free(taken);
        free_acts(&a);
    }
    return status;
}

/* y = x @ W^T + bias with the fastest loop this build has; `group` the inputs a scale and offset cover (32, or
 * 16 for 8-bit codes); returns 0, or 1 (bad arguments), 2 (memory). */
int core_packed_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits, int group,
                       int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                       const float *bias, void *y, int y_dtype) {
    return packed_linear(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, bias, y, y_dtype, 0);
}

/* The same with the plain C loop: the reference the SIMD loops are tested against. */
int core_packed_linear_reference(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                                 int group, int64_t n, int64_t kp, const void *scale, const void *offset,
                                 int scale_dtype, const float *bias, void *y, int y_dtype) {
    return packed_linear(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, bias, y, y_dtype, 1);
}

/* 1 where core_packed_linear_tiles runs (an amx-bf16 build whose process Linux grants the tiles), else 0.
 * Asks for the tiles, once. */
int core_packed_uses_amx(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return amx_granted();
#else
    return 0;
#endif
}

/* The prompt loop this build and CPU have: PROMPT_LOOP_AMX (an amx-bf16 build whose process Linux grants the
 * tiles: the AMX tile loop), PROMPT_LOOP_VECTORS (another AVX512-BF16 build, or the tiles refused: the vector
 * prompt loop) or PROMPT_LOOP_NONE (core_packed_linear_tiles refuses: ERR_NO_TILES). Asks for the tiles, once. */
enum { PROMPT_LOOP_NONE = 0, PROMPT_LOOP_VECTORS = 1, PROMPT_LOOP_AMX = 2 };

int core_packed_prompt_loop(void) {
    if (core_packed_uses_amx()) return PROMPT_LOOP_AMX;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return PROMPT_LOOP_VECTORS;
#else
    return PROMPT_LOOP_NONE;
#endif
}

/* core_packed_linear_tiles(_silu)'s product (`gated`: silu * up of it) by this CPU's prompt loop, for a weight of
 * 32-input groups and 4- or 8-bit codes */
static int prompt_product(int loop, const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                          int64_t n, int64_t kp, scales_t w, const float *bias, void *y, int y_dtype, int gated) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (loop == PROMPT_LOOP_AMX) return packed_linear_amx(x, x_dtype, m, k, codes, bits, n, kp, w, bias, y, y_dtype, gated);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return packed_linear_prompt(x, x_dtype, m, k, codes, bits, n, kp, w, bias, y, y_dtype, gated);
#else
    return ERR_NO_TILES; /* not reached: such a build's core_packed_prompt_loop is PROMPT_LOOP_NONE */
#endif
}

/* y = x @ W^T + bias by the prompt loop (bfloat16 products, float32 sums over all of K: on the AMX tiles, else the
 * vector prompt loop); returns 0, 1 (bad arguments), 2 (memory) or 3 (no prompt loop: a build without AVX512-BF16). */
int core_packed_linear_tiles(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                             int group, int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                             const float *bias, void *y, int y_dtype) {
    if (!arguments_valid(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, y, y_dtype))
        return ERR_ARGS;
    const int loop = core_packed_prompt_loop();
    if (loop == PROMPT_LOOP_NONE) return ERR_NO_TILES;
    if (m == 0) return OK;
    if (group != GROUP || bits == 16) /* the prompt loops dequantize a group of codes under one scale: 16-input
                                          groups take the VNNI loop, 16-bit weights half_linear.c's */
        return packed_linear(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, bias, y,
                             y_dtype, 0);
    const scales_t w = {scale, offset, scale_dtype};
    return prompt_product(loop, x, x_dtype, m, k, codes, bits, n, kp, w, bias, y, y_dtype, 0);
}

/* y [m, n / 2] = silu(gate) * up of a merged [gate | up] weight's product by the prompt loop (each half n / 2
 * rows, a multiple of 16; groups of 32 inputs, 4- or 8-bit codes): the bits of core_packed_linear_tiles and
 * then core_silu_and_mul, without the [m, n] product in memory; returns 0, 1 (bad arguments: other shapes
 * too), 2 (memory) or 3 (no prompt loop). */
int core_packed_linear_tiles_silu(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                                  int group, int64_t n, int64_t kp, const void *scale, const void *offset,
                                  int scale_dtype, const float *bias, void *y, int y_dtype) {
    if (!arguments_valid(x, x_dtype, m, k, codes, bits, group, n, kp, scale, offset, scale_dtype, y, y_dtype) ||
        n % (2 * BLOCK) || group != GROUP || bits == 16 || x_dtype != y_dtype)
        return ERR_ARGS;
    const int loop = core_packed_prompt_loop();
    if (loop == PROMPT_LOOP_NONE) return ERR_NO_TILES;
    if (m == 0) return OK;
    const scales_t w = {scale, offset, scale_dtype};
    return prompt_product(loop, x, x_dtype, m, k, codes, bits, n, kp, w, bias, y, y_dtype, 1);
}
