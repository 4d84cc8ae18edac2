/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept as bfloat16 (a bf16 checkpoint's dense weights), in the
 * packed kernel's block layout: core_packed_linear and the decode stack take it as `bits == 16`.
 *
 * Layout: 16 weight rows side by side, two inputs a row at a time, as one vector holds them:
 * [Np/16][Kp/2][16][2] bfloat16 (block b, pair p, row r, element t: row 16b + r at input 2p + t), N padded
 * to a multiple of 16 and K to a multiple of 64 with zeros. One `vdpbf16ps` multiplies a step (16 rows x 2
 * inputs) by a row's broadcast pair of inputs, so no horizontal sum is ever needed.
 *
 * Arithmetic (every loop, and so every batch: a row's result never depends on the rows beside it): the
 * activations rounded to bfloat16 (a bf16 model's are bf16 already), each output one float32 sum over
 * K in order, pair p adding input 2p + 1's product and then input 2p's, each add rounded to nearest even
 * (a product of two bf16 values is exact in float32), bfloat16 inputs without an exponent (subnormals)
 * read as zero: what `vdpbf16ps` does (Intel's SDM order; checked on a Zen 4 EPYC against the plain C
 * loop, bit for bit). The AVX2 / AVX-512 loops without the instruction do the same with two FMAs. Then
 * the bias (float32) is added and the sum stored as y's dtype (bfloat16: rounded to nearest even).
 *
 * Why: torch's bf16 GEMV reads a one-row step's weights at 13-23 GB/s on a 2-core Zen 4 EPYC, and
 * SmolLM2-135M's decode step in bf16 took ~28 ms (15 of them matmuls); these loops stream the weight
 * once, several blocks at a time, and let the decode stack run a bf16 model's layers in one call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 16
#define ROWS 4                 /* activation rows a tile */
#define BLOCKS 4               /* weight blocks a tile: each broadcast of a row's pair serves them all */
#define CHUNK_ROWS 256         /* activation rows a unit of work (their pairs stay in L2 across its blocks) */

/* a bfloat16 value with a subnormal read as zero */
static inline uint16_t flush_bf16(uint16_t v) { return (v & 0x7f80u) ? v : (uint16_t)(v & 0x8000u); }

/* Activation rows [r0, r1) as pairs of bfloat16 into pairs [M][Kp/2] (uint32: input 2p in the low half),
 * zero past K (loops simple enough to vectorize). */
static void input_pairs(const void *x, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp, uint32_t *pairs) {
    for (int64_t r = r0; r < r1; ++r) {
        uint16_t *row = (uint16_t *)(pairs + r * (kp / 2));
        if (dtype == DT_BF16) {
            const uint16_t *src = (const uint16_t *)x + r * k;
            for (int64_t i = 0; i < k; ++i) row[i] = flush_bf16(src[i]);
        } else {
            const float *src = (const float *)x + r * k;
            for (int64_t i = 0; i < k; ++i) row[i] = flush_bf16(f32_to_bf16(src[i]));
        }
        for (int64_t i = k; i < kp; ++i) row[i] = 0;
    }
}

static inline float bf16_weight(uint16_t v) { return bf16_to_f32(flush_bf16(v)); }

/* The plain C loop: out[i][16 c + r] for `rows` activation rows from m0 and `blocks` blocks from `first`. */
static void tile_generic(const uint16_t *first, int64_t block_elems, int blocks, const uint32_t *pairs, int64_t half,
                         int64_t m0, int rows, float out[ROWS][BLOCKS * BLOCK]) {
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c)
            for (int r = 0; r < BLOCK; ++r) {
                const uint16_t *w = first + c * block_elems + r * 2;
                const uint32_t *xp = pairs + (m0 + i) * half;
                float acc = 0.f;
                for (int64_t p = 0; p < half; ++p) {
                    const uint16_t *wp = w + p * BLOCK * 2;
                    acc = acc + bf16_weight(wp[1]) * bf16_to_f32((uint16_t)(xp[p] >> 16));
                    acc = acc + bf16_weight(wp[0]) * bf16_to_f32((uint16_t)xp[p]);
                }
                out[i][c * BLOCK + r] = acc;
            }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* vdpbf16ps: 16 rows x 2 inputs against a broadcast pair, accumulated in float32 (the order above) */
#define SIMD 1
static inline __attribute__((always_inline)) void tile_simd(const uint16_t *first, int64_t block_elems,
                                                            const int blocks, const uint32_t *pairs, int64_t half,
                                                            int64_t m0, const int rows,
                                                            float out[ROWS][BLOCKS * BLOCK]) {
    __m512 acc[ROWS][BLOCKS];
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < half; ++p) {
        __m512bh w[BLOCKS];
        for (int c = 0; c < blocks; ++c)
            w[c] = (__m512bh)_mm512_loadu_si512((const void *)(first + c * block_elems + p * BLOCK * 2));
        for (int i = 0; i < rows; ++i) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)pairs[(m0 + i) * half + p]);
            for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w[c], xb);
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) _mm512_storeu_ps(out[i] + c * BLOCK, acc[i][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 rows a vector: a step's two halves (rows 0-7, 8-15) of pairs, each split into its odd and even
 * inputs as float32 (a subnormal weight read as zero), two FMAs a pair (odd, then even) */
#define SIMD 1
static inline __m256 high_half(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
static inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256i flush_subnormals(__m256i v) { /* each bf16 whose exponent is zero becomes a signed zero */
    const __m256i exponent = _mm256_set1_epi16(0x7f80), sign = _mm256_set1_epi16((short)0x8000);
    const __m256i none = _mm256_cmpeq_epi16(_mm256_and_si256(v, exponent), _mm256_setzero_si256());
    return _mm256_blendv_epi8(v, _mm256_and_si256(v, sign), none);
}
static inline __attribute__((always_inline)) void tile_simd(const uint16_t *first, int64_t block_elems,
                                                            const int blocks, const uint32_t *pairs, int64_t half,
                                                            int64_t m0, const int rows,
                                                            float out[ROWS][BLOCKS * BLOCK]) {
    /* two blocks at a time at most (4 rows x 2 blocks x 2 halves = 16 accumulators) */
    for (int c0 = 0; c0 < blocks; c0 += 2) {
        const int pair_blocks = blocks - c0 < 2 ? blocks - c0 : 2;
        __m256 acc[ROWS][4];
        for (int i = 0; i < rows; ++i)
            for (int h = 0; h < 2 * pair_blocks; ++h) acc[i][h] = _mm256_setzero_ps();
        for (int64_t p = 0; p < half; ++p) {
            __m256 odd[4], even[4];
            for (int h = 0; h < 2 * pair_blocks; ++h) {
                const __m256i v = flush_subnormals(_mm256_loadu_si256(
                    (const __m256i *)(first + (c0 + h / 2) * block_elems + p * BLOCK * 2 + (h % 2) * 16)));
                odd[h] = high_half(v), even[h] = low_half(v);
            }
            for (int i = 0; i < rows; ++i) {
                const uint32_t xw = pairs[(m0 + i) * half + p];
                const __m256 xo = _mm256_set1_ps(bf16_to_f32((uint16_t)(xw >> 16))),
                             xe = _mm256_set1_ps(bf16_to_f32((uint16_t)xw));
                for (int h = 0; h < 2 * pair_blocks; ++h)
                    acc[i][h] = _mm256_fmadd_ps(even[h], xe, _mm256_fmadd_ps(odd[h], xo, acc[i][h]));
            }
        }
        for (int i = 0; i < rows; ++i)
            for (int h = 0; h < 2 * pair_blocks; ++h) _mm256_storeu_ps(out[i] + c0 * BLOCK + h * 8, acc[i][h]);
    }
}
#endif

typedef struct {
    const void *x;
    int x_dtype;
    int64_t k, kp;
    const uint16_t *w;
    uint32_t *pairs;
    int64_t m, n, half, block_elems, groups, chunks;
    const float *bias;
    void *y;
    int y_dtype, reference;
    int64_t *taken;
} bf16_team;

/* the outputs of blocks [b, b + blocks) for activation rows [m0, m1), ROWS at a time (each count a
 * compile-time constant, so the accumulators stay in registers) */
static void unit_outputs(const bf16_team *c, int64_t b, int blocks, int64_t m0, int64_t m1) {
    float out[ROWS][BLOCKS * BLOCK];
    const uint16_t *first = c->w + b * c->block_elems;
    const int64_t col0 = b * BLOCK, cols = c->n - col0 < blocks * BLOCK ? c->n - col0 : blocks * BLOCK;
    for (int64_t i0 = m0; i0 < m1;) {
        const int rows = m1 - i0 >= ROWS ? ROWS : (int)(m1 - i0);
#if defined(SIMD)
        if (!c->reference) {
#define TILE(R, B) tile_simd(first, c->block_elems, B, c->pairs, c->half, i0, R, out)
#define TILE_ROWS(B) (rows == 4 ? TILE(4, B) : rows == 3 ? TILE(3, B) : rows == 2 ? TILE(2, B) : TILE(1, B))
            if (blocks == BLOCKS)
                TILE_ROWS(BLOCKS);
            else
                TILE_ROWS(blocks == 3 ? 3 : blocks == 2 ? 2 : 1);
#undef TILE_ROWS
#undef TILE
        } else
#endif
            tile_generic(first, c->block_elems, blocks, c->pairs, c->half, i0, rows, out);
        for (int i = 0; i < rows; ++i) {
            const int64_t at = (i0 + i) * c->n + col0;
            if (c->y_dtype == DT_BF16)
                for (int64_t j = 0; j < cols; ++j)
                    ((uint16_t *)c->y)[at + j] = f32_to_bf16(out[i][j] + (c->bias ? c->bias[col0 + j] : 0.f));
            else
                for (int64_t j = 0; j < cols; ++j)
                    ((float *)c->y)[at + j] = out[i][j] + (c->bias ? c->bias[col0 + j] : 0.f);
        }
        i0 += rows;
    }
}

static void bf16_work(void *context, int64_t thread, int64_t threads) {
    const bf16_team *c = context;
    int64_t r0, r1; /* the activations converted by the same team, each thread its share of the rows */
    team_share(c->m, thread, threads, &r0, &r1);
    input_pairs(c->x, c->x_dtype, r0, r1, c->k, c->kp, c->pairs);
    team_barrier(threads);
    const int64_t blocks = (c->n + BLOCK - 1) / BLOCK, units = c->chunks * c->groups;
    for (int64_t unit; (unit = __atomic_fetch_add(c->taken, 1, __ATOMIC_RELAXED)) < units;) {
        const int64_t b = unit % c->groups * BLOCKS, m0 = unit / c->groups * CHUNK_ROWS,
                      m1 = m0 + CHUNK_ROWS < c->m ? m0 + CHUNK_ROWS : c->m;
        unit_outputs(c, b, blocks - b < BLOCKS ? (int)(blocks - b) : BLOCKS, m0, m1);
    }
}

/* y = x @ W^T + bias for W of bfloat16 in the layout above; `reference` takes the plain C loop. */
int core_bf16_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint16_t *w, int64_t n, int64_t kp,
                     const float *bias, void *y, int y_dtype, int reference) {
    if (m == 0) return OK;
    uint32_t *pairs = malloc((size_t)(m * (kp / 2)) * sizeof(uint32_t));
    if (!pairs) return ERR_MEMORY;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    int64_t taken = 0;
    bf16_team team = {x, x_dtype, k, kp, w, pairs, m, n, kp / 2, (kp / 2) * BLOCK * 2, (blocks + BLOCKS - 1) / BLOCKS,
                      (m + CHUNK_ROWS - 1) / CHUNK_ROWS, bias, y, y_dtype, reference, &taken};
    run_team(1, bf16_work, &team);
    free(pairs);
    return OK;
}
