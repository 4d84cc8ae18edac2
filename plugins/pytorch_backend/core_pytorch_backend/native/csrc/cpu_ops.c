/* The small per-layer ops of a decode step, each one pass over its rows instead of a dozen torch ops:
 * paged decode attention, RMSNorm (with the residual add), silu(gate) * up, rotary embedding and the
 * KV-cache store.
 *
 * Each rounds where the plain-torch reference (kernels/reference.py) rounds, so bfloat16 results match
 * it to the last bit or one ulp (the sums run in a different order), and float32 ones to rounding;
 * except decode attention over a bfloat16 cache in the avx512-bf16 build (partial_bf16), which
 * multiplies in bfloat16 (a float32 query and the softmax weights rounded to it), and over an int8 cache
 * (DT_KV8, common.h) in the AVX512-VNNI builds (partial_kv8), which multiplies its codes in integers.
 * Tensors are contiguous; dtype codes as packed_linear.c (0 float32, 1 bfloat16).
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

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64

/* v rounded to the dtype, as a float */
static inline float round_to(float v, int dtype) { return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* a . b; the SIMD versions sum in lanes and reduce once (a plain loop's strict order is 16 scalar adds) */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#endif
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}

/* s[j] <- softcap tanh(s[j] / softcap), Gemma 2's soft-capped scores (softcap 0: none), before the softmax as the
 * reference attention caps them; tanh as (1 - e^-2|x|) / (1 + e^-2|x|) with its sign, so that the loop vectorizes
 * (fast_exp): within a few float32 ulps of tanh, an absolute 1e-7 near 0 */
static inline void cap_scores(float *s, int64_t n, float softcap) {
    if (softcap <= 0.f) return;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
        const float x = s[j] / softcap, e = fast_exp(-2.f * fabsf(x)), t = (1.f - e) / (1.f + e);
        s[j] = softcap * (x < 0.f ? -t : t);
    }
}

/* s[j] = e^(s[j] - top) */
static inline void exp_shifted(float *s, int64_t n, float top) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] = fast_exp(s[j] - top);
}

/* Ask for the cache lines of one position's K or V rows (all KV heads) ahead of their use: the rows of
 * a context are read once per step, after the weights' stream has evicted them. */
#define PREFETCH 4
static inline void prefetch_row(const void *cache, int64_t slot, int64_t row_bytes) {
    const char *start = (const char *)cache + slot * row_bytes;
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(start + offset, 0, 3);
}

/* A walk over positions [begin, begin + left) of one context's paged slots, a block and an offset at a
 * time (no division a position: 32-bit division costs tens of cycles). */
typedef struct {
    const int32_t *table;
    int64_t block, offset, left;
} context_walk;

static inline context_walk context_walk_at(const int32_t *table, int64_t begin, int64_t end, int64_t block_size) {
    const context_walk walk = {table, begin / block_size, begin % block_size, end - begin};
    return walk;
}

/* the walk's next slot (walk->left > 0) */
static inline int64_t walk_slot(context_walk *walk, int64_t block_size) {
    const int64_t slot = (int64_t)walk->table[walk->block] * block_size + walk->offset;
    if (++walk->offset == block_size) walk->offset = 0, ++walk->block;
    --walk->left;
    return slot;
}

/* The next task's K and V rows (every KV head of the positions of `next`), asked for into L2 a position
 * at a time while the current task computes: its rows then arrive while this task's arithmetic runs,
 * where asked for at its own start they keep the arithmetic waiting (a decode step's contexts are read
 * once, from memory). */
static inline void fetch_next_position(context_walk *next, const void *k_cache, const void *v_cache,
                                       int64_t block_size, int64_t row_bytes) {
    if (next->left <= 0) return;
    const int64_t at = walk_slot(next, block_size) * row_bytes;
    for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch((const char *)k_cache + at + o, 0, 2);
        __builtin_prefetch((const char *)v_cache + at + o, 0, 2);
    }
}

/* One partition's share of one row's attention: every query head against positions [begin, end) of
 * the row's context, reading each position's K and V rows of all KV heads in turn (contiguous in the
 * cache). Leaves, per query head, the partition's score maximum, its sum of e^(score - maximum) and the
 * unnormalised sum of e^(score - maximum) * V, in part = [hq][2 + d] floats, for combine() to merge.
 * Inlined with a constant head size and dtypes where they are common ones (see partial_any): loops of
 * 64 elements then unroll fully, where a loop of unknown length spends as long starting and ending as
 * it does working. */
static inline __attribute__((always_inline)) int partial(const void *q, int q_dtype, int64_t row, int64_t hq,
                                                          int64_t d, const void *k_cache, const void *v_cache,
                                                          int cache_dtype, int64_t block_size, int64_t hkv,
                                                          const int32_t *table, int64_t begin, int64_t end,
                                                          float scale, float softcap, float *part) {
    const int64_t group = hq / hkv, span = end - begin;
    float cached[MAX_HEAD_DIM];
    /* one buffer: the queries [hq][d], then the scores [hq][span] */
    float *queries = malloc((size_t)(hq * d + hq * span) * sizeof(float));
    if (!queries) return ERR_MEMORY;
    float *scores = queries + hq * d;
    load_row(q, q_dtype, row * hq * d, hq * d, queries);
    const int64_t row_bytes = hkv * cache_row_bytes(cache_dtype, d);
    for (int64_t j = 0; j < span; ++j) {
        const int64_t slot = slot_of(table, begin + j, block_size);
        if (j + PREFETCH < span) prefetch_row(k_cache, slot_of(table, begin + j + PREFETCH, block_size), row_bytes);
        for (int64_t kv = 0; kv < hkv; ++kv) {
            load_cache_row(k_cache, cache_dtype, slot * hkv + kv, d, cached);
            for (int64_t head = kv * group; head < (kv + 1) * group; ++head)
                scores[head * span + j] = dot(queries + head * d, cached, d) * scale;
        }
    }
    for (int64_t head = 0; head < hq; ++head) {
        float *s = scores + head * span, top = -INFINITY, sum = 0.f;
        cap_scores(s, span, softcap);
        for (int64_t j = 0; j < span; ++j) top = s[j] > top ? s[j] : top;
        exp_shifted(s, span, top);
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < span; ++j) sum += s[j];
        part[head * (2 + d)] = top;
        part[head * (2 + d) + 1] = sum;
        memset(part + head * (2 + d) + 2, 0, (size_t)d * sizeof(float));
    }
    for (int64_t j = 0; j < span; ++j) {
        const int64_t slot = slot_of(table, begin + j, block_size);
        if (j + PREFETCH < span) prefetch_row(v_cache, slot_of(table, begin + j + PREFETCH, block_size), row_bytes);
        for (int64_t kv = 0; kv < hkv; ++kv) {
            load_cache_row(v_cache, cache_dtype, slot * hkv + kv, d, cached);
            for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
                const float p = scores[head * span + j];
                float *a = part + head * (2 + d) + 2;
#pragma omp simd
                for (int64_t i = 0; i < d; ++i) a[i] += p * cached[i];
            }
        }
    }
    free(queries);
    return OK;
}

#if defined(__AVX2__)
#define GATHER_AHEAD 8
/* Each position's K and V rows of every KV head of [begin, begin + span), in cache order (the next
 * positions' rows asked for ahead), as float32: keys and values [hkv][span][d]. */
static inline __attribute__((always_inline)) void gather_rows(const void *k_cache, const void *v_cache, int cache_dtype,
                                                               int64_t block_size, int64_t hkv, int64_t d,
                                                               const int32_t *table, int64_t begin, int64_t span,
                                                               float *keys, float *values) {
    const int64_t row_bytes = hkv * cache_row_bytes(cache_dtype, d);
    for (int64_t j = 0; j < span; ++j) {
        if (j + GATHER_AHEAD < span) {
            const int64_t ahead = slot_of(table, begin + j + GATHER_AHEAD, block_size);
            prefetch_row(k_cache, ahead, row_bytes);
            prefetch_row(v_cache, ahead, row_bytes);
        }
        const int64_t slot = slot_of(table, begin + j, block_size);
        for (int64_t kv = 0; kv < hkv; ++kv) {
            load_cache_row(k_cache, cache_dtype, slot * hkv + kv, d, keys + (kv * span + j) * d);
            load_cache_row(v_cache, cache_dtype, slot * hkv + kv, d, values + (kv * span + j) * d);
        }
    }
}

/* One query head's softmax header (maximum, sum of e^(s - maximum)) over its scores (capped: cap_scores),
 * which become the exponentials. */
static inline void softmax_header(float *s, int64_t span, float softcap, float *part) {
    float top = -INFINITY, sum = 0.f;
    cap_scores(s, span, softcap);
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < span; ++j) top = s[j] > top ? s[j] : top;
    exp_shifted(s, span, top);
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < span; ++j) sum += s[j];
    part[0] = top;
    part[1] = sum;
}

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec_t;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VMUL _mm512_mul_ps
#define VFMA _mm512_fmadd_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
/* lane p of the result = the sum of a[p]'s lanes (a transposing tree of adds and shuffles, where
 * separate reductions take ~10 dependent steps each) */
static inline vec_t lane_sums(const vec_t a[LANES]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                                                      _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#else
#define LANES 8
typedef __m256 vec_t;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VMUL _mm256_mul_ps
#define VFMA _mm256_fmadd_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
static inline vec_t lane_sums(const vec_t a[LANES]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]),
                 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#define MAX_CHUNKS (128 / LANES)

/* partial() with SIMD registers, for heads of D <= 128 (a multiple of the vector width): the
 * partition's K and V rows are gathered as float32 once (for every query head of a group), scores come
 * a vector of positions at a time from register accumulators (lane_sums), and each query head's V sum
 * stays in registers. */
static inline __attribute__((always_inline)) int partial_simd(const void *q, int q_dtype, int64_t row, int64_t hq,
                                                               int64_t d, const void *k_cache, const void *v_cache,
                                                               int cache_dtype, int64_t block_size, int64_t hkv,
                                                               const int32_t *table, int64_t begin, int64_t end,
                                                               float scale, float softcap, context_walk *next,
                                                               float *part) {
    const int64_t group = hq / hkv, span = end - begin, chunks = d / LANES;
    const int64_t slot_bytes = hkv * cache_row_bytes(cache_dtype, d);
    float *queries = malloc((size_t)(hq * d + hq * span + 2 * hkv * span * d) * sizeof(float));
    if (!queries) return ERR_MEMORY;
    float *scores = queries + hq * d, *all_keys = scores + hq * span, *all_values = all_keys + hkv * span * d;
    load_row(q, q_dtype, row * hq * d, hq * d, queries);
    gather_rows(k_cache, v_cache, cache_dtype, block_size, hkv, d, table, begin, span, all_keys, all_values);
    const vec_t scaled = VSET1(scale);
    for (int64_t kv = 0; kv < hkv; ++kv) {
        const float *keys = all_keys + kv * span * d, *values = all_values + kv * span * d;
        for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
            const float *qh = queries + head * d;
            float *s = scores + head * span;
            int64_t j = 0;
            for (; j + LANES <= span; j += LANES) {
                vec_t acc[LANES];
                for (int p = 0; p < LANES; ++p) {
                    const float *k = keys + (j + p) * d;
                    acc[p] = VMUL(VLOAD(qh), VLOAD(k));
                    for (int64_t c = 1; c < chunks; ++c) acc[p] = VFMA(VLOAD(qh + LANES * c), VLOAD(k + LANES * c), acc[p]);
                }
                VSTORE(s + j, VMUL(lane_sums(acc), scaled));
                fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
                fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
            }
            for (; j < span; ++j) s[j] = dot(qh, keys + j * d, d) * scale;
            float *o = part + head * (2 + d);
            softmax_header(s, span, softcap, o);
            vec_t out[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c) out[c] = VZERO();
            for (j = 0; j < span; ++j) {
                const vec_t weight = VSET1(s[j]);
                for (int64_t c = 0; c < chunks; ++c) out[c] = VFMA(weight, VLOAD(values + j * d + LANES * c), out[c]);
            }
            for (int64_t c = 0; c < chunks; ++c) VSTORE(o + 2 + LANES * c, out[c]);
        }
    }
    while (next->left > 0) fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
    free(queries);
    return OK;
}
#endif

#if defined(__AVX512BF16__)
#define MAX_BF16_CHUNKS 4 /* 32 bfloat16 a register: heads of up to 128 */
#define BF16_PASS_VECTORS 16 /* V sums in registers a pass (of 32) */
#define MAX_BF16_PASS_HEADS 4

/* The scores of one query head (queries as bfloat16, chunks registers of 32) against one KV head's K
 * rows of [begin, begin + span), read in place from the bfloat16 cache: vdpbf16ps sums products of
 * pairs in float32, 16 positions at a time into register accumulators (lane_sums). `fetch`: ask for
 * the next tile's K rows and this tile's V rows (the first head of a KV head reads them from memory).
 * Every head asks for two positions of the next task a tile, as partial_simd does: spread over all the
 * task's heads, its rows arrive while this one computes. (Asked for all in the first head's pass, 12
 * cache lines a position, the prefetches queued behind each other and stalled the loop: 64 rows at 192
 * positions, 30 layers, took 20.9 ms instead of 14.8 on a 2-core Zen 4 EPYC.) */
static inline __attribute__((always_inline)) void head_scores_bf16(const __m512bh *qv, int64_t chunks,
                                                                    const uint16_t *k_cache, const uint16_t *v_cache,
                                                                    const int64_t *rows, int64_t span, float scale,
                                                                    int fetch, context_walk *next, int64_t block_size,
                                                                    int64_t slot_bytes, float *s) {
    const __m512 scaled = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 <= span; j += 16) {
        __m512 acc[16];
        for (int p = 0; p < 16; ++p) {
            const int64_t at = rows[j + p];
            if (fetch) {
                if (j + 16 + p < span) {
                    const int64_t ahead = rows[j + 16 + p];
                    for (int64_t c = 0; c < chunks; ++c) __builtin_prefetch(k_cache + ahead + 32 * c, 0, 3);
                }
                for (int64_t c = 0; c < chunks; ++c) __builtin_prefetch(v_cache + at + 32 * c, 0, 3);
            }
            acc[p] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k_cache + at));
            for (int64_t c = 1; c < chunks; ++c)
                acc[p] = _mm512_dpbf16_ps(acc[p], qv[c], (__m512bh)_mm512_loadu_si512(k_cache + at + 32 * c));
        }
        _mm512_storeu_ps(s + j, _mm512_mul_ps(lane_sums(acc), scaled));
        fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
        fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
    }
    for (; j < span; ++j) {
        const int64_t at = rows[j];
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
            acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(k_cache + at + 32 * c));
        s[j] = _mm512_reduce_add_ps(acc) * scale;
    }
}

/* The V sums of `heads` query heads of one KV head from their softmax weights as bfloat16 pairs
 * (weights[h][j / 2] holds positions j and j + 1, an odd span's last pair padded with 0): each two
 * positions' V rows interleaved (unpack lo / hi) into pairs that vdpbf16ps multiplies by the pair of
 * weights, so the sums' lanes come out permuted within each 32 outputs; put back in order on the store. */
static inline __attribute__((always_inline)) void weighted_values_bf16(const uint16_t *v_cache, int64_t d,
                                                                        int64_t chunks, const int64_t *rows,
                                                                        int64_t span, const uint32_t *weights,
                                                                        int64_t pairs, int heads, float *part) {
    __m512 lo[MAX_BF16_PASS_HEADS][MAX_BF16_CHUNKS], hi[MAX_BF16_PASS_HEADS][MAX_BF16_CHUNKS];
    for (int h = 0; h < heads; ++h)
        for (int64_t c = 0; c < chunks; ++c) lo[h][c] = hi[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 2) {
        const uint16_t *first = v_cache + rows[j], *second = j + 1 < span ? v_cache + rows[j + 1] : NULL;
        __m512bh w[MAX_BF16_PASS_HEADS];
        for (int h = 0; h < heads; ++h) w[h] = (__m512bh)_mm512_set1_epi32((int32_t)weights[h * pairs + j / 2]);
        for (int64_t c = 0; c < chunks; ++c) {
            const __m512i a = _mm512_loadu_si512(first + 32 * c),
                          b = second ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
            const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int h = 0; h < heads; ++h) {
                lo[h][c] = _mm512_dpbf16_ps(lo[h][c], low, w[h]);
                hi[h][c] = _mm512_dpbf16_ps(hi[h][c], high, w[h]);
            }
        }
    }
    /* lo's lane i holds output 8 (i / 4) + i % 4 of its 32, hi's the one 4 after it */
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                  second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < heads; ++h)
        for (int64_t c = 0; c < chunks; ++c) {
            float *o = part + h * (2 + d) + 2 + 32 * c;
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo[h][c], first16, hi[h][c]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo[h][c], second16, hi[h][c]));
        }
}

/* partial() in bfloat16 dot products, for a bfloat16 cache and heads of D = 32 c <= 128 (vdpbf16ps:
 * 32 products an instruction where float32 FMAs do 16, and the cache's rows multiplied as they are,
 * with no conversion to float32). The query is rounded to bfloat16 (exact for a bfloat16 model), each
 * score sums its products in float32; the softmax weights are rounded to bfloat16 and their sum taken
 * as rounded, and the V sums accumulate in float32. Against float32 math on the same cache: within
 * bfloat16's rounding of q and of the weights (a relative 2^-9). */
static inline __attribute__((always_inline)) int partial_bf16(const void *q, int q_dtype, int64_t row, int64_t hq,
                                                               int64_t d, const uint16_t *k_cache,
                                                               const uint16_t *v_cache, int64_t block_size,
                                                               int64_t hkv, const int32_t *table, int64_t begin,
                                                               int64_t end, float scale, float softcap,
                                                               context_walk *next, float *part) {
    const int64_t group = hq / hkv, span = end - begin, chunks = d / 32, pairs = (span + 1) / 2;
    const int64_t slot_bytes = hkv * d * (int64_t)sizeof(uint16_t);
    const int pass = BF16_PASS_VECTORS / (2 * chunks) > MAX_BF16_PASS_HEADS ? MAX_BF16_PASS_HEADS
                                                                         : BF16_PASS_VECTORS / (2 * (int)chunks);
    /* each position's first element of KV head 0 in the caches [span], scores [hq][span] float32, weights
       [group][pairs] bfloat16 pairs, the query [d] bfloat16 */
    int64_t *starts = malloc((size_t)span * 2 * sizeof(int64_t) + (size_t)(hq * span) * sizeof(float) +
                             (size_t)(group * pairs) * sizeof(uint32_t) + (size_t)d * sizeof(uint16_t));
    if (!starts) return ERR_MEMORY;
    int64_t *rows = starts + span; /* of the KV head at hand */
    float *scores = (float *)(rows + span);
    uint32_t *weights = (uint32_t *)(scores + hq * span);
    uint16_t *query = (uint16_t *)(weights + group * pairs);
    context_walk walk = context_walk_at(table, begin, end, block_size);
    for (int64_t j = 0; j < span; ++j) starts[j] = walk_slot(&walk, block_size) * hkv * d;
    for (int64_t kv = 0; kv < hkv; ++kv) {
        for (int64_t j = 0; j < span; ++j) rows[j] = starts[j] + kv * d;
        for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
            const int64_t at = (row * hq + head) * d;
            if (q_dtype == DT_BF16) {
                memcpy(query, (const uint16_t *)q + at, (size_t)d * sizeof(uint16_t));
            } else {
                const float *qf = (const float *)q + at;
#pragma omp simd
                for (int64_t i = 0; i < d; ++i) query[i] = f32_to_bf16(qf[i]);
            }
            __m512bh qv[MAX_BF16_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
            float *s = scores + head * span, *header = part + head * (2 + d);
            head_scores_bf16(qv, chunks, k_cache, v_cache, rows, span, scale, head == kv * group, next, block_size,
                             slot_bytes, s);
            cap_scores(s, span, softcap);
            float top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
            for (int64_t j = 0; j < span; ++j) top = s[j] > top ? s[j] : top;
            exp_shifted(s, span, top);
            uint16_t *w = (uint16_t *)(weights + (head - kv * group) * pairs);
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < span; ++j) {
                w[j] = f32_to_bf16(s[j]);
                sum += bf16_to_f32(w[j]);
            }
            if (span % 2) w[span] = 0;
            header[0] = top;
            header[1] = sum;
        }
        for (int64_t head = kv * group; head < (kv + 1) * group; head += pass) {
            const int64_t left = (kv + 1) * group - head;
            const uint32_t *w = weights + (head - kv * group) * pairs;
#define VALUES(H) weighted_values_bf16(v_cache, d, chunks, rows, span, w, pairs, H, part + head * (2 + d))
            switch (left < pass ? left : pass) { /* a constant count, so that the sums stay in registers */
            case 1: VALUES(1); break;
            case 2: VALUES(2); break;
            case 3: VALUES(3); break;
            default: VALUES(4); break;
            }
#undef VALUES
        }
    }
    while (next->left > 0) fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
    free(starts);
    return OK;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KV8_MAX_RUNS 2 /* runs of 64 codes (a register) a row: heads of up to 128 */
#define KV8_PASS_SUMS 16 /* V sum registers a pass: D / 16 a head */
#define KV8_MAX_PASS_HEADS 3

/* A query head in two int8 steps for vpdpbusd against a row's uint8 codes: q ~ step (a + b / 256), a the
 * rounding of q / step (step = max |q| / 127), b that of the rest in 256ths of a step (clamped to 127):
 * ~15 bits of each element, where bfloat16 keeps 8. `total`: the sum of q, for the rows' minimums. */
static inline __attribute__((always_inline)) void kv8_query(const float *q, int64_t d, int8_t *a, int8_t *b,
                                                            float *step, float *total) {
    float top = 0.f, sum = 0.f;
#pragma omp simd reduction(max : top) reduction(+ : sum)
    for (int64_t i = 0; i < d; ++i) {
        top = fabsf(q[i]) > top ? fabsf(q[i]) : top;
        sum += q[i];
    }
    const float s = top > 0.f ? top / 127.f : 1.f, inverse = 1.f / s;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
        const float high = __builtin_nearbyintf(q[i] * inverse);
        const float rest = __builtin_nearbyintf((q[i] * inverse - high) * 256.f);
        a[i] = (int8_t)(high > 127.f ? 127.f : high < -127.f ? -127.f : high);
        b[i] = (int8_t)(rest > 127.f ? 127.f : rest < -127.f ? -127.f : rest);
    }
    *step = s;
    *total = sum;
}

/* sum over a row's codes c of c * q in the query's two steps (its `step` still to apply) */
static inline __attribute__((always_inline)) __m512 kv8_dot(const uint8_t *codes, const __m512i *a, const __m512i *b,
                                                            int64_t runs) {
    __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
    for (int64_t c = 0; c < runs; ++c) {
        const __m512i x = _mm512_loadu_si512(codes + 64 * c);
        high = _mm512_dpbusd_epi32(high, x, a[c]);
        low = _mm512_dpbusd_epi32(low, x, b[c]);
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_set1_ps(1.f / 256.f), _mm512_cvtepi32_ps(high));
}

/* Weights w [n] (>= 0) as int16 for vpdpwssd against the V rows' codes: w ~ step x a, a = round(w / step),
 * step = max w / 32767 (15 bits, where bfloat16 keeps 8); zero from n to an even count. */
static inline __attribute__((always_inline)) float kv8_weights(const float *w, int64_t n, int16_t *a) {
    float top = 0.f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < n; ++i) top = w[i] > top ? w[i] : top;
    const float s = top > 0.f ? top / 32767.f : 1.f, inverse = 1.f / s;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float code = __builtin_nearbyintf(w[i] * inverse);
        a[i] = (int16_t)(code > 32767.f ? 32767.f : code);
    }
    if (n % 2) a[n] = 0;
    return s;
}

static const uint8_t kv8_zeros[128]; /* a padding row's codes (weight 0) */

/* The V sums of `heads` query heads over the codes of the rows, two positions at a time by vpdpwssd: the
 * two positions' 64-byte runs of codes interleaved and widened to 16 bits (unpack lo / hi with each other,
 * then with zeros) so that a dword holds one element of both, multiplied by the two positions' int16
 * weights (kv8_weights, [heads][apart]) broadcast. Lane 4k + l of sum register 4v + r holds element
 * 64v + 16k + 4r + l: times the head's step, plus the minimums' share, and put back in order on the way out. */
static inline __attribute__((always_inline)) void kv8_values(const uint8_t *v_cache, int64_t d, const int64_t *rows,
                                                              int64_t span, const int16_t *w, int64_t apart,
                                                              const float *steps, const float *shares, int heads,
                                                              float *part) {
    const int64_t runs = d / 64;
    const __m512i zero = _mm512_setzero_si512();
    __m512i sums[KV8_MAX_PASS_HEADS][8];
    for (int h = 0; h < heads; ++h)
        for (int64_t r = 0; r < 4 * runs; ++r) sums[h][r] = zero;
    for (int64_t j = 0; j < span; j += 2) {
        const uint8_t *first = v_cache + rows[j], *second = j + 1 < span ? v_cache + rows[j + 1] : kv8_zeros;
        __m512i pair[KV8_MAX_PASS_HEADS];
        for (int h = 0; h < heads; ++h) {
            int32_t both;
            memcpy(&both, w + h * apart + j, sizeof both);
            pair[h] = _mm512_set1_epi32(both);
        }
        for (int64_t v = 0; v < runs; ++v) {
            const __m512i x0 = _mm512_loadu_si512(first + 64 * v), x1 = _mm512_loadu_si512(second + 64 * v);
            const __m512i lo = _mm512_unpacklo_epi8(x0, x1), hi = _mm512_unpackhi_epi8(x0, x1);
            const __m512i r[4] = {_mm512_unpacklo_epi8(lo, zero), _mm512_unpackhi_epi8(lo, zero),
                                  _mm512_unpacklo_epi8(hi, zero), _mm512_unpackhi_epi8(hi, zero)};
            for (int h = 0; h < heads; ++h)
                for (int q = 0; q < 4; ++q) sums[h][4 * v + q] = _mm512_dpwssd_epi32(sums[h][4 * v + q], r[q], pair[h]);
        }
    }
    for (int h = 0; h < heads; ++h) {
        const __m512 step = _mm512_set1_ps(steps[h]), share = _mm512_set1_ps(shares[h]);
        float *out = part + h * (2 + d) + 2;
        for (int64_t v = 0; v < runs; ++v) { /* a 4 x 4 transpose of 128-bit lanes: sum register r's lane k -> out's
                                                  16 elements from 64v + 16k, lane r */
            __m512 r[4];
            for (int q = 0; q < 4; ++q) r[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[h][4 * v + q]), step, share);
            const __m512 t0 = _mm512_shuffle_f32x4(r[0], r[1], 0x44), t1 = _mm512_shuffle_f32x4(r[0], r[1], 0xEE),
                         t2 = _mm512_shuffle_f32x4(r[2], r[3], 0x44), t3 = _mm512_shuffle_f32x4(r[2], r[3], 0xEE);
            _mm512_storeu_ps(out + 64 * v, _mm512_shuffle_f32x4(t0, t2, 0x88));
            _mm512_storeu_ps(out + 64 * v + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
            _mm512_storeu_ps(out + 64 * v + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
            _mm512_storeu_ps(out + 64 * v + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
        }
    }
}

/* partial() over an int8 cache (heads of D = 64 or 128): each score's sum of products of a row's codes
 * and the query in its two int8 steps (kv8_query) by vpdpbusd, 64 products an instruction, read in place
 * from the cache (no conversion), then times the row's scale, plus its minimum times the query's sum;
 * the V sums over the codes by vpdpwssd (kv8_values) against the softmax weights times each row's scale
 * in int16, the minimums' share added once. Against float32 math on the dequantized rows: within
 * ~2^-15 of the query's and the weights' largest element (tests: 2e-4 on random rows). A bfloat16 cache
 * of the same tokens takes as long on a 2-core Zen 4 EPYC (decode_attention_rows.py: 0.9-1.03x at 1-64
 * rows of 192-1,024 positions): the arithmetic, not the bytes, bounds both there. */
static inline __attribute__((always_inline)) int partial_kv8(const void *q, int q_dtype, int64_t row, int64_t hq,
                                                              int64_t d, const uint8_t *k_cache, const uint8_t *v_cache,
                                                              int64_t block_size, int64_t hkv, const int32_t *table,
                                                              int64_t begin, int64_t end, float scale,
                                                              float softcap, context_walk *next, float *part) {
    const int64_t group = hq / hkv, span = end - begin, runs = d / 64, row_bytes = d + KV8_EXTRA;
    const int64_t slot_bytes = hkv * row_bytes;
    const int pass = KV8_PASS_SUMS / (int)(d / 16) > KV8_MAX_PASS_HEADS ? KV8_MAX_PASS_HEADS
                                                                       : KV8_PASS_SUMS / (int)(d / 16);
    /* each position's row offsets [span] (slot) and [span] (the KV head at hand), the rows' scales and
       minimums [span] each, scores [hq][span], the queries [hq][d] float32, then a pass's int16 weights */
    const int64_t apart = (span + 1) / 2 * 2; /* a head's int16 weights, padded to whole pairs */
    int64_t *starts = malloc((size_t)span * 2 * sizeof(int64_t) + (size_t)(2 * span + hq * span + hq * d) * sizeof(float) +
                             (size_t)(KV8_MAX_PASS_HEADS * apart) * sizeof(int16_t));
    if (!starts) return ERR_MEMORY;
    int64_t *rows = starts + span;
    float *scales = (float *)(rows + span), *lows = scales + span, *scores = lows + span, *queries = scores + hq * span;
    int16_t *weights = (int16_t *)(queries + hq * d); /* [KV8_MAX_PASS_HEADS][apart] */
    load_row(q, q_dtype, row * hq * d, hq * d, queries);
    context_walk walk = context_walk_at(table, begin, end, block_size);
    for (int64_t j = 0; j < span; ++j) starts[j] = walk_slot(&walk, block_size) * slot_bytes;
    for (int64_t kv = 0; kv < hkv; ++kv) {
        for (int64_t j = 0; j < span; ++j) {
            rows[j] = starts[j] + kv * row_bytes;
            kv8_tail(k_cache + rows[j], d, scales + j, lows + j);
        }
        for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
            int8_t a[128] __attribute__((aligned(64))), b[128] __attribute__((aligned(64)));
            float step, total;
            kv8_query(queries + head * d, d, a, b, &step, &total);
            __m512i av[KV8_MAX_RUNS], bv[KV8_MAX_RUNS];
            for (int64_t c = 0; c < runs; ++c) av[c] = _mm512_load_si512(a + 64 * c), bv[c] = _mm512_load_si512(b + 64 * c);
            float *s = scores + head * span;
            const __m512 stepped = _mm512_set1_ps(step), summed = _mm512_set1_ps(total), scaled = _mm512_set1_ps(scale);
            int64_t j = 0;
            for (; j + 16 <= span; j += 16) {
                __m512 acc[16];
                for (int p = 0; p < 16; ++p) acc[p] = kv8_dot(k_cache + rows[j + p], av, bv, runs);
                const __m512 dots = _mm512_mul_ps(lane_sums(acc), stepped);
                const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(scales + j), dots, _mm512_mul_ps(_mm512_loadu_ps(lows + j), summed));
                _mm512_storeu_ps(s + j, _mm512_mul_ps(x, scaled));
                fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
                fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
            }
            for (; j < span; ++j)
                s[j] = (scales[j] * _mm512_reduce_add_ps(kv8_dot(k_cache + rows[j], av, bv, runs)) * step + lows[j] * total) *
                       scale;
            softmax_header(s, span, softcap, part + head * (2 + d));
        }
        for (int64_t j = 0; j < span; ++j) kv8_tail(v_cache + rows[j], d, scales + j, lows + j);
        for (int64_t head = kv * group; head < (kv + 1) * group; head += pass) {
            const int64_t left = (kv + 1) * group - head;
            const int count = left < pass ? (int)left : pass;
            float steps[KV8_MAX_PASS_HEADS], shares[KV8_MAX_PASS_HEADS];
            for (int h = 0; h < count; ++h) { /* the weights times the rows' scales; the minimums' share */
                float *w = scores + (head + h) * span, share = 0.f;
#pragma omp simd reduction(+ : share)
                for (int64_t i = 0; i < span; ++i) {
                    share += w[i] * lows[i];
                    w[i] *= scales[i];
                }
                shares[h] = share;
                steps[h] = kv8_weights(w, span, weights + h * apart);
            }
#define VALUES(H) kv8_values(v_cache, d, rows, span, weights, apart, steps, shares, H, part + head * (2 + d))
            switch (count) { /* a constant count, so that the sums stay in registers */
            case 1: VALUES(1); break;
            case 2: VALUES(2); break;
            default: VALUES(3); break;
            }
#undef VALUES
        }
    }
    while (next->left > 0) fetch_next_position(next, k_cache, v_cache, block_size, slot_bytes);
    free(starts);
    return OK;
}
#endif

static int partial_any(const void *q, int q_dtype, int64_t row, int64_t hq, int64_t d, const void *k_cache,
                       const void *v_cache, int cache_dtype, int64_t block_size, int64_t hkv, const int32_t *table,
                       int64_t begin, int64_t end, float scale, float softcap, context_walk *next, float *part) {
#if defined(__AVX2__)
#define PARTIAL(QT, CT, D) partial_simd(q, QT, row, hq, D, k_cache, v_cache, CT, block_size, hkv, table, begin, end, \
                                        scale, softcap, next, part)
#else
#define PARTIAL(QT, CT, D) partial(q, QT, row, hq, D, k_cache, v_cache, CT, block_size, hkv, table, begin, end, \
                                   scale, softcap, part)
#endif
#if defined(__AVX512BF16__)
#define PARTIAL_BF16(QT, D) partial_bf16(q, QT, row, hq, D, k_cache, v_cache, block_size, hkv, table, begin, end, \
                                         scale, softcap, next, part)
    if (cache_dtype == DT_BF16 && (d == 64 || d == 128)) {
        if (q_dtype == DT_BF16) return d == 64 ? PARTIAL_BF16(DT_BF16, 64) : PARTIAL_BF16(DT_BF16, 128);
        return d == 64 ? PARTIAL_BF16(DT_F32, 64) : PARTIAL_BF16(DT_F32, 128);
    }
#undef PARTIAL_BF16
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PARTIAL_KV8(D) partial_kv8(q, q_dtype, row, hq, D, k_cache, v_cache, block_size, hkv, table, begin, end, scale, \
                                   softcap, next, part)
    /* a constant head size (the query's dtype only reaches one load_row: not worth a copy each) */
    if (cache_dtype == DT_KV8 && (d == 64 || d == 128)) return d == 64 ? PARTIAL_KV8(64) : PARTIAL_KV8(128);
#undef PARTIAL_KV8
#endif
    if (q_dtype == DT_BF16 && cache_dtype == DT_BF16) {
        if (d == 64) return PARTIAL(DT_BF16, DT_BF16, 64);
        if (d == 128) return PARTIAL(DT_BF16, DT_BF16, 128);
    } else if (q_dtype == DT_F32 && cache_dtype == DT_F32) {
        if (d == 64) return PARTIAL(DT_F32, DT_F32, 64);
        if (d == 128) return PARTIAL(DT_F32, DT_F32, 128);
    } else if (q_dtype == DT_F32 && cache_dtype == DT_BF16) { /* a float32 model over a bfloat16 cache (GGUF) */
        if (d == 64) return PARTIAL(DT_F32, DT_BF16, 64);
        if (d == 128) return PARTIAL(DT_F32, DT_BF16, 128);
    }
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) /* there partial_kv8 takes these (and they cost seconds
                                                           of the build) */
    if (cache_dtype == DT_KV8 && (d == 64 || d == 128))
        return d == 64 ? PARTIAL(q_dtype, DT_KV8, 64) : PARTIAL(q_dtype, DT_KV8, 128);
#endif
    return partial(q, q_dtype, row, hq, d, k_cache, v_cache, cache_dtype, block_size, hkv, table, begin, end, scale,
                   softcap, part);
#undef PARTIAL
}

/* Merge the `count` partitions of one row (`apart` floats from one to the next) into the outputs of
 * its query heads. */
static void combine(const float *parts, int64_t count, int64_t apart, int64_t hq, int64_t d, int64_t row,
                    int q_dtype, void *out) {
    float acc[MAX_HEAD_DIM];
    for (int64_t head = 0; head < hq; ++head) {
        float top = -INFINITY, total = 0.f;
        for (int64_t p = 0; p < count; ++p) {
            const float m = parts[p * apart + head * (2 + d)];
            top = m > top ? m : top;
        }
        memset(acc, 0, (size_t)d * sizeof(float));
        for (int64_t p = 0; p < count; ++p) {
            const float *part = parts + p * apart + head * (2 + d);
            const float weight = count == 1 ? 1.f : expf(part[0] - top);
            total += weight * part[1];
            for (int64_t i = 0; i < d; ++i) acc[i] += weight * part[2 + i];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
        store_row(out, q_dtype, (row * hq + head) * d, d, acc);
    }
}

/* out[R, Hq, D] = softmax(q K^T * scale) V for R decode rows, each over its own paged context (softcap > 0: the
 * scores capped first, cap_scores):
 * caches [num_blocks, block_size, Hkv, D] (an int8 cache's rows D + KV8_EXTRA bytes); tables [R, table_width] int32; lengths [R] int32 (cached
 * tokens, the new one included); window > 0 keeps the last `window` positions only.
 *
 * The work is cut into tasks of one row and up to PARTITION positions (so that one long sequence
 * still keeps every thread busy), each leaving a partial softmax per query head that a second pass
 * merges. */
#define PARTITION 64

/* The first position a row attends to: the last `window` of its context, or all of it */
static inline int64_t context_start(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

/* Task `index`'s positions [*begin, *end) of its row, found from *row on (first: each row's first task) */
static inline void task_at(const int64_t *first, const int32_t *lengths, int64_t window, int64_t index,
                           int64_t *row, int64_t *begin, int64_t *end) {
    while (first[*row + 1] <= index) ++*row;
    *begin = context_start(lengths[*row], window) + (index - first[*row]) * PARTITION;
    *end = *begin + PARTITION < lengths[*row] ? *begin + PARTITION : lengths[*row];
}

typedef struct {
    const void *q;
    int q_dtype;
    int64_t rows, hq, d;
    const void *k_cache, *v_cache;
    int cache_dtype;
    int64_t block_size, hkv;
    const int32_t *tables;
    int64_t table_width;
    const int32_t *lengths;
    int64_t window;
    float scale, softcap;
    void *out;
    const int64_t *first; /* each row's first partition */
    float *parts;
    int64_t stride, partitions;
    int status;
} attention_team;

static void attention_work(void *context, int64_t thread, int64_t threads) {
    attention_team *c = context;
    /* each thread its contiguous share of the tasks, so that it knows its next one (fetch_next_position) */
    int64_t index, last, r = 0, begin, end;
    team_share(c->partitions, thread, threads, &index, &last);
    for (; index < last; ++index) {
        task_at(c->first, c->lengths, c->window, index, &r, &begin, &end);
        context_walk next = {NULL, 0, 0, 0}; /* none: this thread's last task */
        if (index + 1 < last) {
            int64_t next_row = r, next_begin, next_end;
            task_at(c->first, c->lengths, c->window, index + 1, &next_row, &next_begin, &next_end);
            next = context_walk_at(c->tables + next_row * c->table_width, next_begin, next_end, c->block_size);
        }
        const int s = partial_any(c->q, c->q_dtype, r, c->hq, c->d, c->k_cache, c->v_cache, c->cache_dtype,
                                  c->block_size, c->hkv, c->tables + r * c->table_width, begin, end, c->scale,
                                  c->softcap, &next, c->parts + index * c->stride);
        if (s != OK) team_fail(&c->status, s);
    }
    team_barrier(threads);
    int64_t row, rows_end;
    team_share(c->rows, thread, threads, &row, &rows_end);
    for (; row < rows_end; ++row)
        if (c->first[row + 1] > c->first[row]) /* an empty context has no output to write */
            combine(c->parts + c->first[row] * c->stride, c->first[row + 1] - c->first[row], c->stride, c->hq, c->d,
                    row, c->q_dtype, c->out);
}

int core_decode_attention(const void *q, int q_dtype, int64_t rows, int64_t hq, int64_t d, const void *k_cache,
                          const void *v_cache, int cache_dtype, int64_t block_size, int64_t hkv,
                          const int32_t *tables, int64_t table_width, const int32_t *lengths, int64_t window,
                          float scale, float softcap, void *out) {
    if ((rows > 0 && (!q || !tables || !lengths || !out)) || !k_cache || !v_cache || rows < 0 || hkv <= 0 ||
        hq % hkv || hq / hkv > MAX_GROUP || d <= 0 || d > MAX_HEAD_DIM || block_size <= 0 ||
        (q_dtype != DT_F32 && q_dtype != DT_BF16) || (cache_dtype != DT_F32 && cache_dtype != DT_BF16 &&
                                                       cache_dtype != DT_KV8) || !(softcap >= 0.f))
        return ERR_ARGS;
    if (rows == 0) return OK;
    const int64_t stride = hq * (2 + d); /* floats of one partition */
    int64_t *first = malloc((size_t)(rows + 1) * sizeof(int64_t)); /* each row's first partition */
    if (!first) return ERR_MEMORY;
    int64_t work = 0;
    first[0] = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t span = lengths[r] - context_start(lengths[r], window);
        first[r + 1] = first[r] + (span > 0 ? (span + PARTITION - 1) / PARTITION : 0);
        work += span;
    }
    const int64_t partitions = first[rows];
    float *parts = malloc((size_t)(partitions * stride + 1) * sizeof(float));
    if (!parts) {
        free(first);
        return ERR_MEMORY;
    }
    attention_team ctx = {q, q_dtype, rows, hq, d, k_cache, v_cache, cache_dtype, block_size, hkv, tables,
                          table_width, lengths, window, scale, softcap, out, first, parts, stride, partitions, OK};
    run_team(work * hq * d > 50000, attention_work, &ctx);
    const int status = ctx.status;
    free(parts);
    free(first);
    return status;
}

typedef struct {
    const void *x;
    int x_dtype;
    int64_t tokens, hidden;
    const void *residual;
    const float *w;
    int fused;
    float eps;
    void *out, *residual_out;
    int status;
    const float *bias; /* a LayerNorm's (centered) */
    int centered;      /* 1: LayerNorm, the row less its mean normalised, times w plus bias in float32 */
} rms_team;

static void rms_work(void *context, int64_t thread, int64_t threads) {
    rms_team *c = context;
    const int64_t hidden = c->hidden;
    const int x_dtype = c->x_dtype;
    float *row = malloc((size_t)hidden * sizeof(float)), *other = malloc((size_t)hidden * sizeof(float));
    if (!row || !other) {
        team_fail(&c->status, ERR_MEMORY);
    } else {
        int64_t t, end;
        for (team_share(c->tokens, thread, threads, &t, &end); t < end; ++t) {
            load_row(c->x, x_dtype, t * hidden, hidden, row);
            if (c->residual) {
                load_row(c->residual, x_dtype, t * hidden, hidden, other);
                for (int64_t i = 0; i < hidden; ++i) row[i] = round_to(row[i] + other[i], x_dtype);
                store_row(c->residual_out, x_dtype, t * hidden, hidden, row);
            }
            if (c->centered) { /* LayerNorm: the row less its mean (two passes, as the variance is then exact) */
                float total = 0.f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < hidden; ++i) total += row[i];
                const float mean = total / (float)hidden;
                for (int64_t i = 0; i < hidden; ++i) row[i] -= mean;
            }
            float squares = 0.f;
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
            const float inv = 1.f / sqrtf(squares / (float)hidden + c->eps);
            if (c->centered)
                for (int64_t i = 0; i < hidden; ++i) row[i] = row[i] * inv * c->w[i] + c->bias[i];
            else
                for (int64_t i = 0; i < hidden; ++i)
                    row[i] = c->fused ? row[i] * inv * c->w[i]
                                      : round_to(c->w[i] * round_to(row[i] * inv, x_dtype), x_dtype);
            store_row(c->out, x_dtype, t * hidden, hidden, row);
        }
    }
    free(row);
    free(other);
}

/* RMSNorm as HF Llama: with a residual, s = x + residual (rounded to the dtype) is written to
 * residual_out and normalised; out = weight * round(s * rsqrt(mean(s^2) + eps)) (float32: one product,
 * as torch.rms_norm). x, residual, out, residual_out [T, H] of x_dtype; weight [H] of w_dtype. */
int core_rms_norm(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                  const void *weight, int w_dtype, float eps, void *out, void *residual_out) {
    if ((tokens > 0 && (!x || !out)) || !weight || tokens < 0 || hidden <= 0 || (residual && !residual_out) ||
        (x_dtype != DT_F32 && x_dtype != DT_BF16) || (w_dtype != DT_F32 && w_dtype != DT_BF16))
        return ERR_ARGS;
    float *w = malloc((size_t)hidden * sizeof(float));
    if (!w) return ERR_MEMORY;
    load_row(weight, w_dtype, 0, hidden, w);
    rms_team ctx = {x, x_dtype, tokens, hidden, residual, w, x_dtype == DT_F32 && w_dtype == DT_F32, eps, out,
                    residual_out, OK};
    run_team(tokens * hidden > PARALLEL_MIN_WORK, rms_work, &ctx);
    const int status = ctx.status;
    free(w);
    return status;
}

/* Gemma's RMSNorm: out = s * rsqrt(mean(s^2) + eps) * weight all in float32 (weight float32: the model's 1 + w),
 * rounded once to x_dtype, as models/gemma3.py's GemmaRMSNorm computes it (x upcast, core_rms_norm's float32
 * product, then rounded); s as core_rms_norm's (x + residual rounded to the dtype, written to residual_out). */
/* LayerNorm (StableLM's): s as core_rms_norm's (x + residual rounded to the dtype, written to residual_out), out =
 * (s - mean(s)) / sqrt(var(s) + eps) * weight + bias in float32 (the biased variance, as torch), rounded once to
 * x_dtype. weight and bias [H] of w_dtype; bias NULL: none. */
int core_layer_norm(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                    const void *weight, const void *bias, int w_dtype, float eps, void *out, void *residual_out) {
    if ((tokens > 0 && (!x || !out)) || !weight || tokens < 0 || hidden <= 0 || (residual && !residual_out) ||
        (x_dtype != DT_F32 && x_dtype != DT_BF16) || (w_dtype != DT_F32 && w_dtype != DT_BF16))
        return ERR_ARGS;
    float *w = calloc((size_t)(2 * hidden), sizeof(float));
    if (!w) return ERR_MEMORY;
    load_row(weight, w_dtype, 0, hidden, w);
    if (bias) load_row(bias, w_dtype, 0, hidden, w + hidden);
    rms_team ctx = {x, x_dtype, tokens, hidden, residual, w, 1, eps, out, residual_out, OK, w + hidden, 1};
    run_team(tokens * hidden > PARALLEL_MIN_WORK, rms_work, &ctx);
    free(w);
    return ctx.status;
}

int core_rms_norm_float(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                        const float *weight, float eps, void *out, void *residual_out) {
    if ((tokens > 0 && (!x || !out)) || !weight || tokens < 0 || hidden <= 0 || (residual && !residual_out) ||
        (x_dtype != DT_F32 && x_dtype != DT_BF16))
        return ERR_ARGS;
    rms_team ctx = {x, x_dtype, tokens, hidden, residual, weight, 1, eps, out, residual_out, OK};
    run_team(tokens * hidden > PARALLEL_MIN_WORK, rms_work, &ctx);
    return ctx.status;
}

typedef struct {
    const void *x;
    int dtype;
    int64_t tokens, inner;
    int act; /* ACT_SILU, ACT_GELU_TANH, or ACT_RELU2 / ACT_XIELU (ungated) */
    void *out;
    int status;
    int ungated; /* 1: x [T, I] is the activation's input alone (times an up of ones: the same bits as act(x)) */
    const float *params; /* ACT_XIELU's alpha_p, alpha_n, beta, eps */
} act_team;

/* x[i] <- relu(x[i])^2 in float32, rounded once by the store (torch's square(relu(x)): relu is exact, the square
 * of a bfloat16 exact in float32); a NaN stays NaN as in torch */
static inline void relu_squared(float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float r = x[i] < 0.f ? 0.f : x[i];
        x[i] = r * r;
    }
}

/* x[i] <- xIELU(x[i]) of p = {alpha_p, alpha_n, beta, eps} (softplus and the sum already taken, as transformers'
 * XIELUActivation takes them; values of the dtype): alpha_p x x + beta x for x > 0, else
 * (expm1(min(x, eps)) - x) alpha_n + beta x, each operation rounded to the dtype as torch's are */
static inline void xielu(float *x, int64_t n, int dtype, const float *p) {
    const int bf16 = dtype == DT_BF16;
#define R(v) (bf16 ? bf16_to_f32(f32_to_bf16(v)) : (v))
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i], linear = R(p[2] * v);
        if (v > 0.f) {
            x[i] = R(R(R(p[0] * v) * v) + linear);
        } else {
            const float low = v < p[3] ? v : p[3];
            x[i] = R(R(R(R(expm1f(low)) - v) * p[1]) + linear);
        }
    }
#undef R
}

static void act_work(void *context, int64_t thread, int64_t threads) {
    act_team *c = context;
    const int64_t inner = c->inner;
    const int dtype = c->dtype;
    float *gate = malloc((size_t)inner * sizeof(float)), *up = malloc((size_t)inner * sizeof(float));
    if (!gate || !up) {
        team_fail(&c->status, ERR_MEMORY);
    } else {
        int64_t t, end;
        for (team_share(c->tokens, thread, threads, &t, &end); t < end; ++t) {
            if (c->ungated) {
                load_row(c->x, dtype, t * inner, inner, gate);
                for (int64_t i = 0; i < inner; ++i) up[i] = 1.f;
            } else {
                load_row(c->x, dtype, t * 2 * inner, inner, gate);
                load_row(c->x, dtype, t * 2 * inner + inner, inner, up);
            }
            if (c->act == ACT_RELU2)
                relu_squared(gate, inner);
            else if (c->act == ACT_XIELU)
                xielu(gate, inner, dtype, c->params);
            else if (c->act == ACT_GELU_TANH)
                gelu_tanh_times(gate, up, inner, dtype);
            else
                silu_times(gate, up, inner, dtype);
            store_row(c->out, dtype, t * inner, inner, gate);
        }
    }
    free(gate);
    free(up);
}

/* out[T, I] = act(gate) * up for x[T, 2I] = [gate | up] (act: ACT_SILU, or ACT_GELU_TANH for Gemma), rounding
 * after the activation as torch does. */
int core_act_and_mul(const void *x, int dtype, int64_t tokens, int64_t inner, int act, void *out) {
    if ((tokens > 0 && (!x || !out)) || tokens < 0 || inner <= 0 || (dtype != DT_F32 && dtype != DT_BF16) ||
        (act != ACT_SILU && act != ACT_GELU_TANH))
        return ERR_ARGS;
    act_team ctx = {x, dtype, tokens, inner, act, out, OK, 0, NULL};
    run_team(tokens * inner > PARALLEL_MIN_WORK, act_work, &ctx);
    return ctx.status;
}

/* out[T, I] = act(x) for x[T, I] (an ungated MLP's: StarCoder 2's GELU-tanh, Nemotron's relu^2, Apertus's xIELU of
 * params[4]; NULL for the others), the values of core_act_and_mul's act(gate) with an up of ones; out may be x. */
int core_act(const void *x, int dtype, int64_t tokens, int64_t inner, int act, const float *params, void *out) {
    if ((tokens > 0 && (!x || !out)) || tokens < 0 || inner <= 0 || (dtype != DT_F32 && dtype != DT_BF16) ||
        (act != ACT_SILU && act != ACT_GELU_TANH && act != ACT_RELU2 && act != ACT_XIELU) ||
        (act == ACT_XIELU && !params))
        return ERR_ARGS;
    act_team ctx = {x, dtype, tokens, inner, act, out, OK, 1, params};
    run_team(tokens * inner > PARALLEL_MIN_WORK, act_work, &ctx);
    return ctx.status;
}

/* out[T, I] = silu(gate) * up for x[T, 2I] = [gate | up] */
int core_silu_and_mul(const void *x, int dtype, int64_t tokens, int64_t inner, void *out) {
    return core_act_and_mul(x, dtype, tokens, inner, ACT_SILU, out);
}

typedef struct {
    const void *q, *k;
    int dtype;
    int64_t hq, hkv, d, rotary_dim, q_row_stride, k_row_stride;
    const int64_t *positions;
    const void *cos_table, *sin_table;
    int table_dtype;
    void *q_out, *k_out;
    int64_t tokens;
} rotary_team;

static void rotary_work(void *context, int64_t thread, int64_t threads) {
    const rotary_team *c = context;
    const int64_t d = c->d, half = c->rotary_dim / 2, hq = c->hq, hkv = c->hkv;
    const int dtype = c->dtype;
    int64_t t, end;
    for (team_share(c->tokens, thread, threads, &t, &end); t < end; ++t) {
        float cs[MAX_HEAD_DIM / 2], sn[MAX_HEAD_DIM / 2], x[MAX_HEAD_DIM], y[MAX_HEAD_DIM];
        load_row(c->cos_table, c->table_dtype, c->positions[t] * half, half, cs);
        load_row(c->sin_table, c->table_dtype, c->positions[t] * half, half, sn);
        for (int64_t i = 0; i < half; ++i) {
            cs[i] = round_to(cs[i], dtype);
            sn[i] = round_to(sn[i], dtype);
        }
        for (int64_t head = 0; head < hq + hkv; ++head) {
            const int is_q = head < hq;
            const void *src = is_q ? c->q : c->k;
            const int64_t offset = is_q ? t * c->q_row_stride + head * d : t * c->k_row_stride + (head - hq) * d;
            load_row(src, dtype, offset, d, x);
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                y[i] = round_to(round_to(x[i] * cs[i], dtype) + round_to(x[i + half] * -sn[i], dtype), dtype);
                y[i + half] = round_to(round_to(x[i + half] * cs[i], dtype) + round_to(x[i] * sn[i], dtype), dtype);
            }
            for (int64_t i = 2 * half; i < d; ++i) y[i] = x[i]; /* beyond rotary_dim: as they are */
            store_row(is_q ? c->q_out : c->k_out, dtype, is_q ? (t * hq + head) * d : (t * hkv + head - hq) * d, d, y);
        }
    }
}

/* core_rotary on each head's first rotary_dim values (even, at most D; cos / sin [max_position, rotary_dim / 2]),
 * the rest of each head copied as it is: partial_rotary_factor (Phi-4-mini's 0.75), each rotated value as
 * core_rotary gives it for a head of rotary_dim. */
int core_rotary_part(const void *q, const void *k, int dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                     int64_t rotary_dim, int64_t q_row_stride, int64_t k_row_stride, const int64_t *positions,
                     const void *cos_table, const void *sin_table, int table_dtype, int64_t max_position, void *q_out,
                     void *k_out) {
    if ((tokens > 0 && (!q || !k || !positions || !q_out || !k_out)) || !cos_table || !sin_table || tokens < 0 ||
        d <= 0 || d > MAX_HEAD_DIM || rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > d ||
        (dtype != DT_F32 && dtype != DT_BF16) || (table_dtype != DT_F32 && table_dtype != DT_BF16))
        return ERR_ARGS;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return ERR_ARGS;
    rotary_team ctx = {q, k, dtype, hq, hkv, d, rotary_dim, q_row_stride, k_row_stride, positions, cos_table,
                       sin_table, table_dtype, q_out, k_out, tokens};
    run_team(tokens * (hq + hkv) * d > PARALLEL_MIN_WORK, rotary_work, &ctx);
    return OK;
}

/* Neox (rotate-half) rotary embedding of q [T, Hq, D] and k [T, Hkv, D] into q_out and k_out
 * (contiguous), rows of the inputs `*_row_stride` elements apart (views into a fused qkv output).
 * cos / sin are [max_position, D / 2] of table_dtype (float32, or bfloat16 in a model cast to it). Rounds as the
 * reference: cos and sin to the dtype, then each product and their sum. */
int core_rotary(const void *q, const void *k, int dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                int64_t q_row_stride, int64_t k_row_stride, const int64_t *positions, const void *cos_table,
                const void *sin_table, int table_dtype, int64_t max_position, void *q_out, void *k_out) {
    if (d % 2) return ERR_ARGS;
    return core_rotary_part(q, k, dtype, tokens, hq, hkv, d, d, q_row_stride, k_row_stride, positions, cos_table,
                            sin_table, table_dtype, max_position, q_out, k_out);
}

/* Write each new token's K and V ([T, Hkv, D], rows `*_row_stride` apart) into its cache slot
 * (caches [slots, Hkv, D] of cache_dtype; an int8 cache's rows quantized, store_cache_row); a negative slot
 * is skipped, one past the cache an error. */
int core_store_kv(const void *k, const void *v, int dtype, int64_t tokens, int64_t hkv, int64_t d,
                  int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots, void *k_cache, void *v_cache,
                  int cache_dtype, int64_t num_slots) {
    if ((tokens > 0 && (!k || !v || !slots)) || !k_cache || !v_cache || tokens < 0 || d <= 0 || hkv <= 0 ||
        (dtype != DT_F32 && dtype != DT_BF16) ||
        (cache_dtype != DT_F32 && cache_dtype != DT_BF16 && cache_dtype != DT_KV8))
        return ERR_ARGS;
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= num_slots) return ERR_ARGS;
    const int64_t width = hkv * d;
    float *row = malloc((size_t)width * sizeof(float));
    if (!row) return ERR_MEMORY;
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        load_row(k, dtype, t * k_row_stride, width, row);
        for (int64_t kv = 0; kv < hkv; ++kv) store_cache_row(k_cache, cache_dtype, slots[t] * hkv + kv, d, row + kv * d);
        load_row(v, dtype, t * v_row_stride, width, row);
        for (int64_t kv = 0; kv < hkv; ++kv) store_cache_row(v_cache, cache_dtype, slots[t] * hkv + kv, d, row + kv * d);
    }
    free(row);
    return OK;
}
