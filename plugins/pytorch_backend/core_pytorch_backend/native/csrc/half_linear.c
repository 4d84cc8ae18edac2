/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept as 16-bit floats (bfloat16 or float16), in the packed
 * kernel's block layout: core_packed_linear and the decode stack take it as `bits == 16`, the weight's
 * dtype in the place of the scales' (there are none).
 *
 * Layouts, 16 weight rows side by side so that one vector holds a step of them and no horizontal sum is
 * ever needed (N padded to a multiple of 16 and K to a multiple of 64 with zeros):
 *   bfloat16: [Np/16][Kp/2][16][2] (block b, pair p, row r, element t: row 16b + r at input 2p + t): a
 *             step is 16 rows x 2 inputs, what one `vdpbf16ps` multiplies by a broadcast pair;
 *   float16:  [Np/16][Kp][16] (row 16b + r at input i): a step is 16 rows x 1 input.
 *
 * Two arithmetics, by the activations' dtype (a model's activations have one dtype, so all its rows take
 * the same; neither depends on the batch, each output one float32 sum over K in a fixed order):
 *   bfloat16 activations (a bf16 model; bfloat16 weights only): pair p adds input 2p + 1's exact product
 *     and then input 2p's, each add rounded to nearest even, bf16 inputs without an exponent (subnormals)
 *     read as zero: what `vdpbf16ps` does (Intel's SDM order; checked on a Zen 4 EPYC against the plain
 *     C loop, bit for bit). The AVX2 / AVX-512 loops without the instruction do the same with two FMAs.
 *   float32 activations (a float32 model whose weights are 16-bit values, a GGUF file's F16 / BF16
 *     tensors): fma(w, x, sum) input by input from 0 to K - 1, the weights exact in float32, the
 *     activations as they are: the float32 model's own products, only the order of the sums fixed.
 * Then the bias (float32) is added and the sum stored as y's dtype (bfloat16: rounded to nearest even).
 *
 * Why: torch's bf16 GEMV reads a one-row step's weights at 13-23 GB/s on a 2-core Zen 4 EPYC, and
 * SmolLM2-135M's decode step in bf16 took ~28 ms (15 of them matmuls); a 16-bit GGUF file served as
 * float32 read twice the bytes. These loops stream the weight once, several blocks at a time, and let
 * the decode stack run such models' layers in one call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 16
#define ROWS 4         /* activation rows a tile */
#define BLOCKS HALF_TILE_BLOCKS /* weight blocks a tile: each broadcast of a row's input serves them all */
#define CHUNK_ROWS 256 /* activation rows a unit of work (their inputs stay in L2 across its blocks) */

/* a bfloat16 value with a subnormal read as zero */
static inline uint16_t flush_bf16(uint16_t v) { return (v & 0x7f80u) ? v : (uint16_t)(v & 0x8000u); }

typedef struct { /* one call: the weight, the activations as the loops read them, the outputs */
    const void *x;
    int x_dtype, w_dtype;
    int64_t k, kp;
    const uint16_t *w;
    void *acts; /* bf16 mode: uint32 pairs [M][Kp/2] (input 2p in the low half); float32 mode: [M][Kp] */
    int64_t m, n, block_elems, groups, chunks;
    const float *bias;
    void *y;
    int y_dtype, reference;
    int64_t *taken;
    int gated; /* core_half_bf16_blocks's gated tiles: y [M, n / 2] = silu(gate) * up (see store_gated) */
} half_team;

/* Activation rows [r0, r1) as the loops read them, zero past K (loops simple enough to vectorize). */
static void prepare_rows(const half_team *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        if (c->x_dtype == DT_BF16) {
            uint16_t *row = (uint16_t *)c->acts + r * c->kp;
            const uint16_t *src = (const uint16_t *)c->x + r * c->k;
            for (int64_t i = 0; i < c->k; ++i) row[i] = flush_bf16(src[i]);
            for (int64_t i = c->k; i < c->kp; ++i) row[i] = 0;
        } else {
            float *row = (float *)c->acts + r * c->kp;
            memcpy(row, (const float *)c->x + r * c->k, (size_t)c->k * sizeof(float));
            for (int64_t i = c->k; i < c->kp; ++i) row[i] = 0.f;
        }
    }
}

/* weight element i (an input) of row r of a block, as float32 */
static inline float weight_at(const uint16_t *block, int w_dtype, int r, int64_t i) {
    if (w_dtype == DT_F16) return f16_to_f32(block[i * BLOCK + r]);
    return bf16_to_f32(block[(i / 2) * BLOCK * 2 + r * 2 + i % 2]);
}

/* The plain C loops: out[i][16 c + r] for `rows` activation rows from m0 and `blocks` blocks from `first`. */
static void tile_generic(const half_team *t, const uint16_t *first, int blocks, int64_t m0, int rows,
                         float out[ROWS][BLOCKS * BLOCK]) {
    const int64_t kp = t->kp;
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c)
            for (int r = 0; r < BLOCK; ++r) {
                const uint16_t *block = first + c * t->block_elems;
                float acc = 0.f;
                if (t->x_dtype == DT_BF16) {
                    const uint16_t *x = (const uint16_t *)t->acts + (m0 + i) * kp;
                    for (int64_t p = 0; p < kp / 2; ++p) { /* fmaf: the exact product added, rounded once (GCC
                                                               12 at -O3 vectorized `acc + w * x` here wrongly) */
                        const uint16_t *wp = block + p * BLOCK * 2 + r * 2;
                        acc = fmaf(bf16_to_f32(flush_bf16(wp[1])), bf16_to_f32(x[2 * p + 1]), acc);
                        acc = fmaf(bf16_to_f32(flush_bf16(wp[0])), bf16_to_f32(x[2 * p]), acc);
                    }
                } else {
                    const float *x = (const float *)t->acts + (m0 + i) * kp;
                    for (int64_t j = 0; j < kp; ++j) acc = fmaf(weight_at(block, t->w_dtype, r, j), x[j], acc);
                }
                out[i][c * BLOCK + r] = acc;
            }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SIMD 1
/* float32 mode, 16 rows a vector: bfloat16 pairs split into their even and odd inputs, float16 converted */
static inline __attribute__((always_inline)) void tile_f32(const half_team *t, const uint16_t *first, const int blocks,
                                                           int64_t m0, const int rows, const int w_dtype,
                                                           float out[ROWS][BLOCKS * BLOCK]) {
    const int64_t kp = t->kp, be = t->block_elems;
    const float *x = (const float *)t->acts + m0 * kp;
    __m512 acc[ROWS][BLOCKS];
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_setzero_ps();
    if (w_dtype == DT_F16) {
        for (int64_t j = 0; j < kp; ++j) {
            __m512 w[BLOCKS];
            for (int c = 0; c < blocks; ++c)
                w[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(first + c * be + j * BLOCK)));
            for (int i = 0; i < rows; ++i) {
                const __m512 xv = _mm512_set1_ps(x[i * kp + j]);
                for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_fmadd_ps(w[c], xv, acc[i][c]);
            }
        }
    } else {
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t p = 0; p < kp / 2; ++p) {
            __m512 even[BLOCKS], odd[BLOCKS];
            for (int c = 0; c < blocks; ++c) {
                const __m512i v = _mm512_loadu_si512((const void *)(first + c * be + p * BLOCK * 2));
                even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                odd[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            }
            for (int i = 0; i < rows; ++i) {
                const __m512 xe = _mm512_set1_ps(x[i * kp + 2 * p]), xo = _mm512_set1_ps(x[i * kp + 2 * p + 1]);
                for (int c = 0; c < blocks; ++c)
                    acc[i][c] = _mm512_fmadd_ps(odd[c], xo, _mm512_fmadd_ps(even[c], xe, acc[i][c]));
            }
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) _mm512_storeu_ps(out[i] + c * BLOCK, acc[i][c]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bf16 mode: vdpbf16ps, 16 rows x 2 inputs against a broadcast pair, accumulated in float32 */
static inline __attribute__((always_inline)) void tile_bf16(const half_team *t, const uint16_t *first,
                                                            const int blocks, int64_t m0, const int rows,
                                                            float out[ROWS][BLOCKS * BLOCK]) {
    const int64_t half = t->kp / 2;
    const uint32_t *pairs = (const uint32_t *)t->acts + m0 * half;
    __m512 acc[ROWS][BLOCKS];
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < half; ++p) {
        __m512bh w[BLOCKS];
        for (int c = 0; c < blocks; ++c)
            w[c] = (__m512bh)_mm512_loadu_si512((const void *)(first + c * t->block_elems + p * BLOCK * 2));
        for (int i = 0; i < rows; ++i) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)pairs[i * half + p]);
            for (int c = 0; c < blocks; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w[c], xb);
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int c = 0; c < blocks; ++c) _mm512_storeu_ps(out[i] + c * BLOCK, acc[i][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD 1
#define TILE_BF16_FMA 1
static inline __m256 high_half(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
static inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256i flush_subnormals(__m256i v) { /* each bf16 whose exponent is zero becomes a signed zero */
    const __m256i exponent = _mm256_set1_epi16(0x7f80), sign = _mm256_set1_epi16((short)0x8000);
    const __m256i none = _mm256_cmpeq_epi16(_mm256_and_si256(v, exponent), _mm256_setzero_si256());
    return _mm256_blendv_epi8(v, _mm256_and_si256(v, sign), none);
}
/* 8 rows a vector, two blocks at a time at most (4 rows x 2 blocks x 2 halves = 16 accumulators). bf16
 * mode: a step's two halves (rows 0-7, 8-15) of pairs split into odd and even inputs (a subnormal weight
 * read as zero), two FMAs a pair (odd, then even). float32 mode: fma input by input (float16 converted). */
static inline __attribute__((always_inline)) void tile_avx2(const half_team *t, const uint16_t *first,
                                                            const int blocks, int64_t m0, const int rows,
                                                            const int mode_f32, const int w_dtype,
                                                            float out[ROWS][BLOCKS * BLOCK]) {
    const int64_t kp = t->kp, be = t->block_elems;
    for (int c0 = 0; c0 < blocks; c0 += 2) {
        const int pair_blocks = blocks - c0 < 2 ? blocks - c0 : 2;
        __m256 acc[ROWS][4];
        for (int i = 0; i < rows; ++i)
            for (int h = 0; h < 2 * pair_blocks; ++h) acc[i][h] = _mm256_setzero_ps();
        if (mode_f32 && w_dtype == DT_F16) {
            const float *x = (const float *)t->acts + m0 * kp;
            for (int64_t j = 0; j < kp; ++j) {
                __m256 w[4];
                for (int h = 0; h < 2 * pair_blocks; ++h)
                    w[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(first + (c0 + h / 2) * be + j * BLOCK + (h % 2) * 8)));
                for (int i = 0; i < rows; ++i) {
                    const __m256 xv = _mm256_set1_ps(x[i * kp + j]);
                    for (int h = 0; h < 2 * pair_blocks; ++h) acc[i][h] = _mm256_fmadd_ps(w[h], xv, acc[i][h]);
                }
            }
        } else {
            for (int64_t p = 0; p < kp / 2; ++p) {
                __m256 odd[4], even[4];
                for (int h = 0; h < 2 * pair_blocks; ++h) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(first + (c0 + h / 2) * be + p * BLOCK * 2 + (h % 2) * 16));
                    if (!mode_f32) v = flush_subnormals(v);
                    odd[h] = high_half(v), even[h] = low_half(v);
                }
                for (int i = 0; i < rows; ++i) {
                    __m256 xe, xo;
                    if (mode_f32) {
                        const float *x = (const float *)t->acts + (m0 + i) * kp;
                        xe = _mm256_set1_ps(x[2 * p]), xo = _mm256_set1_ps(x[2 * p + 1]);
                    } else {
                        const uint32_t xw = ((const uint32_t *)t->acts)[(m0 + i) * (kp / 2) + p];
                        xe = _mm256_set1_ps(bf16_to_f32((uint16_t)xw)), xo = _mm256_set1_ps(bf16_to_f32((uint16_t)(xw >> 16)));
                    }
                    for (int h = 0; h < 2 * pair_blocks; ++h)
                        acc[i][h] = mode_f32 ? _mm256_fmadd_ps(odd[h], xo, _mm256_fmadd_ps(even[h], xe, acc[i][h]))
                                             : _mm256_fmadd_ps(even[h], xe, _mm256_fmadd_ps(odd[h], xo, acc[i][h]));
                }
            }
        }
        for (int i = 0; i < rows; ++i)
            for (int h = 0; h < 2 * pair_blocks; ++h) _mm256_storeu_ps(out[i] + c0 * BLOCK + h * 8, acc[i][h]);
    }
}
#endif

/* one tile by the build's SIMD loop for the call's mode (AVX512-BF16 builds: tile_bf16 / tile_f32; the
 * other SIMD builds, AVX-512 VNNI without BF16 among them: tile_avx2) (each count a compile-time constant, so that the
 * accumulators stay in registers) */
#if defined(SIMD)
static inline __attribute__((always_inline)) void tile_simd(const half_team *t, const uint16_t *first,
                                                            const int blocks, int64_t m0, const int rows,
                                                            float out[ROWS][BLOCKS * BLOCK]) {
#if defined(TILE_BF16_FMA)
    if (t->x_dtype == DT_BF16)
        tile_avx2(t, first, blocks, m0, rows, 0, DT_BF16, out);
    else if (t->w_dtype == DT_F16)
        tile_avx2(t, first, blocks, m0, rows, 1, DT_F16, out);
    else
        tile_avx2(t, first, blocks, m0, rows, 1, DT_BF16, out);
#else /* AVX512-BF16 */
    if (t->x_dtype == DT_BF16)
        tile_bf16(t, first, blocks, m0, rows, out);
    else if (t->w_dtype == DT_F16)
        tile_f32(t, first, blocks, m0, rows, DT_F16, out);
    else
        tile_f32(t, first, blocks, m0, rows, DT_BF16, out);
#endif
}
#endif

/* A gated tile's rows [i0, i0 + rows) into y [M, n / 2]: out's first `width` columns are the gate's (product columns
 * col0 on), the next `width` its up's (columns n / 2 + col0 on); each plus its bias and rounded as a store of the
 * product would (bfloat16), then silu(gate) * up by silu_times: the bits of the product and then cpu_ops.c's
 * silu * up, without the [M, n] product in memory. */
static void store_gated(const half_team *c, float out[ROWS][BLOCKS * BLOCK], int64_t i0, int rows, int64_t col0,
                        int64_t width) {
    const int64_t half = c->n / 2;
    for (int i = 0; i < rows; ++i) {
        float *gate = out[i], *up = out[i] + width;
        if (c->bias) /* tested out here: inside, GCC made it masked loads, which a NULL bias made 60% of the call
                        (each a fault suppressed in microcode on a Zen 4 EPYC) */
            for (int64_t j = 0; j < width; ++j) {
                gate[j] += c->bias[col0 + j];
                up[j] += c->bias[half + col0 + j];
            }
        if (c->y_dtype == DT_BF16)
            for (int64_t j = 0; j < 2 * width; ++j) out[i][j] = bf16_to_f32(f32_to_bf16(out[i][j]));
        silu_times(gate, up, width, c->y_dtype);
        store_row(c->y, c->y_dtype, (i0 + i) * half + col0, width, gate);
    }
}

/* the outputs of y's columns [col0, col0 + 16 blocks) for activation rows [m0, m1), ROWS at a time, from the
 * `blocks` weight blocks at `first` */
static void outputs_of_blocks(const half_team *c, const uint16_t *first, int64_t col0, int blocks, int64_t m0,
                              int64_t m1) {
    float out[ROWS][BLOCKS * BLOCK];
    const int64_t cols = c->n - col0 < blocks * BLOCK ? c->n - col0 : blocks * BLOCK;
    for (int64_t i0 = m0; i0 < m1;) {
        const int rows = m1 - i0 >= ROWS ? ROWS : (int)(m1 - i0);
#if defined(SIMD)
        if (!c->reference) {
#define TILE(R, B) tile_simd(c, first, B, i0, R, out)
#define TILE_ROWS(B) (rows == 4 ? TILE(4, B) : rows == 3 ? TILE(3, B) : rows == 2 ? TILE(2, B) : TILE(1, B))
            if (blocks == BLOCKS)
                TILE_ROWS(BLOCKS);
            else
                TILE_ROWS(blocks == 3 ? 3 : blocks == 2 ? 2 : 1);
#undef TILE_ROWS
#undef TILE
        } else
#endif
            tile_generic(c, first, blocks, i0, rows, out);
        if (c->gated) {
            store_gated(c, out, i0, rows, col0, blocks / 2 * BLOCK);
            i0 += rows;
            continue;
        }
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

/* the outputs of blocks [b, b + blocks) for activation rows [m0, m1) */
static void unit_outputs(const half_team *c, int64_t b, int blocks, int64_t m0, int64_t m1) {
    outputs_of_blocks(c, c->w + b * c->block_elems, b * BLOCK, blocks, m0, m1);
}

static void half_work(void *context, int64_t thread, int64_t threads) {
    const half_team *c = context;
    int64_t r0, r1; /* the activations prepared by the same team, each thread its share of the rows */
    team_share(c->m, thread, threads, &r0, &r1);
    prepare_rows(c, r0, r1);
    team_barrier(threads);
    const int64_t blocks = (c->n + BLOCK - 1) / BLOCK, units = c->chunks * c->groups;
    for (int64_t unit; (unit = __atomic_fetch_add(c->taken, 1, __ATOMIC_RELAXED)) < units;) {
        const int64_t b = unit % c->groups * BLOCKS, m0 = unit / c->groups * CHUNK_ROWS,
                      m1 = m0 + CHUNK_ROWS < c->m ? m0 + CHUNK_ROWS : c->m;
        unit_outputs(c, b, blocks - b < BLOCKS ? (int)(blocks - b) : BLOCKS, m0, m1);
    }
}

/* y = x @ W^T + bias for W of `w_dtype` (DT_BF16 or DT_F16) in the layouts above; `reference` takes the
 * plain C loop. bfloat16 activations need bfloat16 weights (else 1: bad arguments). */
int core_half_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint16_t *w, int w_dtype, int64_t n,
                     int64_t kp, const float *bias, void *y, int y_dtype, int reference) {
    if ((w_dtype != DT_BF16 && w_dtype != DT_F16) || (x_dtype == DT_BF16 && w_dtype != DT_BF16)) return ERR_ARGS;
    if (m == 0) return OK;
    void *acts = malloc((size_t)(m * kp) * (x_dtype == DT_BF16 ? 2 : 4));
    if (!acts) return ERR_MEMORY;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    int64_t taken = 0;
    half_team team = {x, x_dtype, w_dtype, k, kp, w, acts, m, n, kp * BLOCK, (blocks + BLOCKS - 1) / BLOCKS,
                      (m + CHUNK_ROWS - 1) / CHUNK_ROWS, bias, y, y_dtype, reference, &taken};
    run_team(1, half_work, &team);
    free(acts);
    return OK;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* y's columns [col0, col0 + 16 blocks) (at most HALF_TILE_BLOCKS) for activation rows [m0, m1) by the
 * bf16 loop above (vdpbf16ps), from bfloat16 weight blocks at `first` ([blocks][Kp/2][16][2]) and bfloat16
 * activation rows `acts` ([M][Kp], zero beyond K): packed_linear.c's vector prompt loop, which dequantizes a
 * 4- or 8-bit weight a few blocks at a time and multiplies each as a bfloat16 weight is. `gated`: the first half
 * of the blocks are a [gate | up] product's gate blocks from column col0, the second half their up blocks (from
 * n / 2 + col0), and y [M, n / 2] takes silu(gate) * up (store_gated). */
void core_half_bf16_blocks(const uint16_t *first, int blocks, const uint16_t *acts, int64_t kp, int64_t m0, int64_t m1,
                           int64_t col0, int64_t n, const float *bias, void *y, int y_dtype, int gated) {
    const half_team c = {NULL, DT_BF16, DT_BF16, kp, kp, first, (void *)acts, m1, n, kp * BLOCK, 0, 0, bias, y, y_dtype,
                         0, NULL, gated};
    outputs_of_blocks(&c, first, col0, blocks, m0, m1);
}
#endif
