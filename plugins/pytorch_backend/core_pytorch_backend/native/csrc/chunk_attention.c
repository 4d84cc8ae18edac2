/* Causal attention of prefill chunks over the paged KV cache: the rows of sequences with more than one
 * new token (decode rows go to core_decode_attention).
 *
 * Sequence s has n = query_len[s] new tokens in the flat batch from row query_start[s] on, at positions
 * L - n .. L - 1 of its L = seq_len[s] cached tokens (the chunk's own keys already stored). Query row
 * i attends to positions j <= its own (and j > its position - window when window > 0).
 *
 * Work is cut into tasks of one sequence, one KV head and a tile of up to ROWS query rows: the tile's
 * rows times the G query heads that share the KV head are the task's query vectors, so each key and
 * value read from the cache serves all of them. Keys are taken KEYS at a time, converted to float32
 * and transposed ([D][KEYS]) so that a vector's KEYS scores are D multiply-adds of whole vectors (no
 * horizontal sums), and merged into each vector's running softmax (maximum, sum, weighted values: the
 * flash-attention recurrence). Key tiles start at multiples of KEYS whatever the query tile, so a row's
 * sums run in the same order in any chunk. e^x is fast_exp (relative error ~2e-7). An int8 cache's rows
 * (DT_KV8) are dequantized to float32 into the tile here (load_cache_row). Over a bfloat16 cache with
 * heads of 64 or 128, the avx512-bf16 and amx-bf16 builds take the same tasks and tiles in bfloat16 dot
 * products instead (run_task_bf16 below), and so does an int8 cache there: its codes (0..255, exact in
 * bfloat16) are the keys and values, each score the codes' sum times the row's scale plus its minimum
 * times the query's sum, each weight times its row's scale (the minimums' share summed apart). The
 * amx-bf16 build, where Linux grants the tiles, takes larger tasks on the AMX tiles (run_task_amx, a
 * bfloat16 cache only). Default model, 2,000 tokens teacher-forced in chunks of 256 over an int8 cache,
 * Zen 4 EPYC: 99.00% agreement with the float32 model this way, 99.15% by the float32 loop above, 98.65%
 * with the rows dequantized and rounded to bfloat16; a 128-token chunk 1.1-1.2x the bfloat16 cache's time
 * at 128-4,096 positions, against 1.6-1.7x by the float32 loop (benchmarks/attention_context.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "common.h"
#include "amx.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define KEYS 16
#define MAX_VECTORS 64 /* query vectors of one task: ROWS = MAX_VECTORS / G rows (at least 1) */
#define BLOCK 8 /* query vectors merged together (attend_block) */
#define MAX_CHUNK_HEAD_DIM 256
#define MAX_CHUNK_GROUP 64

typedef struct {
    int32_t seq, head, first, count; /* query rows first .. first + count - 1 of the sequence's chunk */
} chunk_task;

/* The element of q and out [T, Hq, D] where the task's query vector `vec` starts (vectors: its rows times
 * the G query heads of its KV head, row by row) */
static inline int64_t vector_at(const int32_t *query_start, chunk_task task, int64_t vec, int64_t group, int64_t hq,
                                int64_t d) {
    const int64_t row = query_start[task.seq] + task.first + vec / group;
    return (row * hq + task.head * group + vec % group) * d;
}

/* The first position of the key tiles (of `keys` positions, at multiples of it) that a task starting at
 * position first_pos needs: the tile of its window's first position, or 0 */
static inline int64_t first_key_tile(int64_t first_pos, int64_t window, int64_t keys) {
    const int64_t lowest = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    return lowest / keys * keys;
}

typedef struct {
    float q[MAX_VECTORS + BLOCK][MAX_CHUNK_HEAD_DIM]; /* scaled queries, padded to whole BLOCKs */
    float acc[MAX_VECTORS + BLOCK][MAX_CHUNK_HEAD_DIM];
    float top[MAX_VECTORS + BLOCK], sum[MAX_VECTORS + BLOCK];
    float kt[MAX_CHUNK_HEAD_DIM][KEYS]; /* the key tile, transposed */
    float v[KEYS][MAX_CHUNK_HEAD_DIM];
} chunk_scratch;

/* the task's key tile [j0, j0 + KEYS) (positions past `last` are zero) into s->kt and s->v */
static void load_keys(const void *k_cache, const void *v_cache, int cache_dtype, const int32_t *table,
                      int64_t block_size, int64_t hkv, int64_t head, int64_t d, int64_t j0, int64_t last,
                      chunk_scratch *s) {
    float row[MAX_CHUNK_HEAD_DIM];
    for (int64_t jj = 0; jj < KEYS; ++jj) {
        if (j0 + jj > last) {
            for (int64_t i = 0; i < d; ++i) s->kt[i][jj] = 0.f, s->v[jj][i] = 0.f;
            continue;
        }
        const int64_t at = slot_of(table, j0 + jj, block_size) * hkv + head;
        load_cache_row(k_cache, cache_dtype, at, d, row);
        for (int64_t i = 0; i < d; ++i) s->kt[i][jj] = row[i];
        load_cache_row(v_cache, cache_dtype, at, d, s->v[jj]);
    }
}

/* Merge key tile [j0, j0 + KEYS) into the BLOCK vectors from `first` on (vector v at position pos[v]).
 * BLOCK vectors at a time, so that each transposed key row read feeds BLOCK independent sums (one
 * vector's D multiply-adds into one register would wait on each other's latency). Always inlined with
 * D a constant where it is a common head size (see run_task), so the loops over D unroll. */
static inline __attribute__((always_inline)) void attend_block(chunk_scratch *s, int64_t first, int64_t d,
                                                                int64_t j0, const int64_t *pos, int64_t window) {
    float score[BLOCK][KEYS];
    for (int v = 0; v < BLOCK; ++v)
#pragma omp simd
        for (int jj = 0; jj < KEYS; ++jj) score[v][jj] = 0.f;
    for (int64_t i = 0; i < d; ++i) {
        const float *k = s->kt[i];
        for (int v = 0; v < BLOCK; ++v) {
            const float qi = s->q[first + v][i];
#pragma omp simd
            for (int jj = 0; jj < KEYS; ++jj) score[v][jj] += qi * k[jj];
        }
    }
    for (int v = 0; v < BLOCK; ++v) {
        const int64_t vec = first + v;
        float top_tile = -INFINITY;
        if (j0 + KEYS - 1 <= pos[v] && (window <= 0 || j0 > pos[v] - window)) { /* every key visible */
#pragma omp simd reduction(max : top_tile)
            for (int jj = 0; jj < KEYS; ++jj) top_tile = score[v][jj] > top_tile ? score[v][jj] : top_tile;
        } else {
            for (int jj = 0; jj < KEYS; ++jj) {
                const int64_t j = j0 + jj;
                const int keep = j <= pos[v] && (window <= 0 || j > pos[v] - window);
                score[v][jj] = keep ? score[v][jj] : -INFINITY;
                top_tile = score[v][jj] > top_tile ? score[v][jj] : top_tile;
            }
        }
        if (top_tile == -INFINITY) continue; /* nothing of this tile is visible to this row */
        const float top = s->top[vec] > top_tile ? s->top[vec] : top_tile;
        const float rescale = s->top[vec] == -INFINITY ? 0.f : fast_exp(s->top[vec] - top);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int jj = 0; jj < KEYS; ++jj) {
            score[v][jj] = score[v][jj] == -INFINITY ? 0.f : fast_exp(score[v][jj] - top);
            total += score[v][jj];
        }
        s->top[vec] = top;
        s->sum[vec] = s->sum[vec] * rescale + total;
        float *acc = s->acc[vec];
        for (int64_t i0 = 0; i0 < d; i0 += KEYS) { /* KEYS outputs at a time, kept in a register */
            float part[KEYS];
#pragma omp simd
            for (int ii = 0; ii < KEYS; ++ii) part[ii] = acc[i0 + ii] * rescale;
            for (int jj = 0; jj < KEYS; ++jj) {
                const float w = score[v][jj];
                const float *value = s->v[jj] + i0;
#pragma omp simd
                for (int ii = 0; ii < KEYS; ++ii) part[ii] += w * value[ii];
            }
#pragma omp simd
            for (int ii = 0; ii < KEYS; ++ii) acc[i0 + ii] = part[ii];
        }
    }
}

static void attend_any(chunk_scratch *s, int64_t first, int64_t d, int64_t j0, const int64_t *pos, int64_t window) {
    if (d == 64) attend_block(s, first, 64, j0, pos, window);
    else if (d == 128) attend_block(s, first, 128, j0, pos, window);
    else attend_block(s, first, d, j0, pos, window);
}

static void run_task(const void *q, int q_dtype, int64_t hq, int64_t d, const void *k_cache, const void *v_cache,
                     int cache_dtype, int64_t block_size, int64_t hkv, const int32_t *query_start,
                     const int32_t *query_len, const int32_t *seq_len, const int32_t *tables, int64_t table_width,
                     int64_t window, float scale, void *out, chunk_task task, chunk_scratch *s) {
    const int64_t group = hq / hkv, n = query_len[task.seq], length = seq_len[task.seq];
    const int64_t vectors = task.count * group, first_pos = length - n + task.first;
    const int64_t padded = (vectors + BLOCK - 1) / BLOCK * BLOCK; /* the padding vectors repeat the last row */
    const int32_t *table = tables + (int64_t)task.seq * table_width;
    int64_t pos[MAX_VECTORS + BLOCK];
    for (int64_t vec = 0; vec < padded; ++vec) {
        const int64_t real = vec < vectors ? vec : vectors - 1;
        pos[vec] = first_pos + real / group;
        load_row(q, q_dtype, vector_at(query_start, task, real, group, hq, d), d, s->q[vec]);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) s->q[vec][i] *= scale, s->acc[vec][i] = 0.f;
        s->top[vec] = -INFINITY, s->sum[vec] = 0.f;
    }
    const int64_t last = first_pos + task.count - 1;
    for (int64_t j0 = first_key_tile(first_pos, window, KEYS); j0 <= last; j0 += KEYS) {
        load_keys(k_cache, v_cache, cache_dtype, table, block_size, hkv, task.head, d, j0, last, s);
        for (int64_t vec = 0; vec < padded; vec += BLOCK) attend_any(s, vec, d, j0, pos + vec, window);
    }
    for (int64_t vec = 0; vec < vectors; ++vec) {
        const float inv = s->sum[vec] > 0.f ? 1.f / s->sum[vec] : 0.f;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) s->acc[vec][i] *= inv;
        store_row(out, q_dtype, vector_at(query_start, task, vec, group, hq, d), d, s->acc[vec]);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The same attention in bfloat16 dot products, for a bfloat16 cache and heads of D = 64 or 128 (the
 * avx512-bf16 and amx-bf16 builds): vdpbf16ps multiplies pairs of bfloat16 and sums them in float32, 32
 * products an instruction where float32 FMAs do 16, reading the cache's rows as they are. A float32
 * query is split into its bfloat16 rounding and the rounding of the rest (q = hi + lo to ~16 bits), each
 * multiplied by the keys, so that its scores are as close to float32 math as the cache allows; a
 * bfloat16 query is exact as it is. The softmax weights of a key tile are rounded to bfloat16 (a
 * relative 2^-9; their sum taken as rounded) and the V sums run in float32, as in decode attention's
 * partial_bf16 (cpu_ops.c). Default model, teacher-forced over 8,000 tokens in prefill chunks of 256
 * (benchmarks/quant_accuracy.py --tokens 8000, Zen 5 EPYC): 99.68% top-1 agreement with the float32
 * oracle, against 99.78% with the float32 loop above and 99.56% with the query rounded once; a
 * 128-token chunk 1.9x faster at 128 positions of context and 2.2x at 4,096 than the float32 loop
 * (benchmarks/attention_context.py --dtype float32/bfloat16). Key tiles start at multiples of KEYS, so
 * a row's sums run in the same order in any chunk, as above.
 *
 * Per key tile, once for the task's vectors: the keys' pairs transposed (kt[p] lane j: key j's pair p),
 * so that a vector's KEYS scores are D / 2 multiply-adds of whole vectors; and the values of each two
 * keys interleaved (vt: unpack lo / hi, as weighted_values_bf16), so that one multiply-add takes two
 * keys' weights for 16 outputs; the V sums stay in that lane order until the task's end. */
#define BF16_MAX_PAIRS 64 /* D <= 128 */
#define BF16_MAX_SUMS 8 /* V sum registers a vector: two per 32 outputs */
#define QK_BLOCK 8 /* query vectors scored together: each key register read serves all of them */
#define PV_SUMS 16 /* V sum registers a pass: PV_SUMS / (D / 16) vectors share each value register read */

typedef struct {
    uint32_t q[MAX_VECTORS + QK_BLOCK][BF16_MAX_PAIRS]; /* the queries as bfloat16 pairs */
    uint32_t q_rest[MAX_VECTORS + QK_BLOCK][BF16_MAX_PAIRS]; /* a float32 query's remainder (q - its bfloat16) */
    __m512 acc[MAX_VECTORS + QK_BLOCK][BF16_MAX_SUMS];
    float top[MAX_VECTORS + QK_BLOCK], sum[MAX_VECTORS + QK_BLOCK], rescale[MAX_VECTORS + QK_BLOCK];
    uint32_t w[MAX_VECTORS + QK_BLOCK][KEYS / 2]; /* the tile's softmax weights as bfloat16 pairs */
    __m512i kt[BF16_MAX_PAIRS];
    __m512i vt[KEYS / 2][BF16_MAX_SUMS];
    /* an int8 cache only: each query's sum, the minimums' share of its V sums, the key tile's rows' codes as
       bfloat16 (exact: 0..255) and their scales and minimums */
    float q_sum[MAX_VECTORS + QK_BLOCK], low_share[MAX_VECTORS + QK_BLOCK];
    uint16_t codes[2][KEYS][2 * BF16_MAX_PAIRS];
    float k_scale[KEYS], k_low[KEYS], v_scale[KEYS], v_low[KEYS];
} bf16_scratch;

/* r[i] lane j <- r[j] lane i (16 x 16 int32) */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int m = 0; m < 4; ++m) { /* 128-bit lane k of u[m], u[4 + m], u[8 + m], u[12 + m] make row 4k + m */
        const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44),
                      y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

/* the cache rows of keys [j0, j0 + count) of KV head `head` into k[] and v[] (positions past `last`: zeros) */
static inline void key_rows(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int64_t block_size,
                            int64_t hkv, int64_t head, int64_t d, int64_t j0, int64_t last, int count,
                            const uint16_t **k, const uint16_t **v) {
    static const uint16_t zeros[MAX_CHUNK_HEAD_DIM];
    for (int jj = 0; jj < count; ++jj) {
        if (j0 + jj > last) {
            k[jj] = v[jj] = zeros;
            continue;
        }
        const int64_t at = (slot_of(table, j0 + jj, block_size) * hkv + head) * d;
        k[jj] = k_cache + at, v[jj] = v_cache + at;
    }
}

/* 16 keys' pairs, transposed: kt[p] lane j <- key j's pair p (D / 2 vectors) */
static inline void transposed_pairs(const uint16_t *const *k, int64_t d, __m512i *kt) {
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
        __m512i r[16];
        for (int jj = 0; jj < 16; ++jj) r[jj] = _mm512_loadu_si512((const void *)(k[jj] + 2 * p0));
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(kt + p0 + i), r[i]);
    }
}

/* the values of keys 2 jp and 2 jp + 1 interleaved into pairs (unpack lo / hi of each 32 outputs):
 * vt[jp * pair_apart + t * column_apart] for t < D / 16 */
static inline void interleaved_values(const uint16_t *const *v, int pairs, int64_t d, __m512i *vt, int64_t pair_apart,
                                      int64_t column_apart) {
    for (int jp = 0; jp < pairs; ++jp)
        for (int64_t c = 0; c < d / 32; ++c) {
            const __m512i a = _mm512_loadu_si512((const void *)(v[2 * jp] + 32 * c)),
                          b = _mm512_loadu_si512((const void *)(v[2 * jp + 1] + 32 * c));
            _mm512_storeu_si512((void *)(vt + jp * pair_apart + 2 * c * column_apart), _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512((void *)(vt + jp * pair_apart + (2 * c + 1) * column_apart), _mm512_unpackhi_epi16(a, b));
        }
}

/* key_rows() of an int8 cache: each row's codes as bfloat16 (exact) into s->codes, its scale and minimum into
 * s->k_scale / k_low and v_scale / v_low (positions past `last`: zero codes, scale and minimum) */
static inline void key_rows_kv8(const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table,
                                int64_t block_size, int64_t hkv, int64_t head, int64_t d, int64_t j0, int64_t last,
                                bf16_scratch *s, const uint16_t **k, const uint16_t **v) {
    const uint8_t *caches[2] = {k_cache, v_cache};
    float *scales[2] = {s->k_scale, s->v_scale}, *lows[2] = {s->k_low, s->v_low};
    for (int jj = 0; jj < KEYS; ++jj) {
        const int past = j0 + jj > last;
        const int64_t at = past ? 0 : (slot_of(table, j0 + jj, block_size) * hkv + head) * (d + KV8_EXTRA);
        for (int c = 0; c < 2; ++c) {
            const uint8_t *row = caches[c] + at;
            uint16_t *codes = s->codes[c][jj];
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) codes[i] = past ? 0 : f32_to_bf16((float)row[i]);
            float scale = 0.f, low = 0.f;
            if (!past) kv8_tail(row, d, &scale, &low);
            scales[c][jj] = scale, lows[c][jj] = low;
        }
        k[jj] = s->codes[0][jj], v[jj] = s->codes[1][jj];
    }
}

/* key tile [j0, j0 + KEYS) of KV head `head` into s->kt and s->vt (positions past `last`: zero), from a
 * bfloat16 cache's rows or an int8 cache's codes */
static inline __attribute__((always_inline)) void load_keys_bf16(const void *k_cache, const void *v_cache,
                                                                  int cache_dtype, const int32_t *table,
                                                                  int64_t block_size, int64_t hkv, int64_t head,
                                                                  int64_t d, int64_t j0, int64_t last,
                                                                  bf16_scratch *s) {
    const uint16_t *k[KEYS], *v[KEYS];
    if (cache_dtype == DT_KV8)
        key_rows_kv8(k_cache, v_cache, table, block_size, hkv, head, d, j0, last, s, k, v);
    else
        key_rows(k_cache, v_cache, table, block_size, hkv, head, d, j0, last, KEYS, k, v);
    transposed_pairs(k, d, s->kt);
    interleaved_values(v, KEYS / 2, d, s->vt[0], BF16_MAX_SUMS, 1);
}

/* a vector's normalized V sums (each 32 outputs as two vectors in the interleaved lane order: lo's lane i
 * holds output 8 (i / 4) + i % 4 of its 32, hi's the one 4 after it), each plus `add` (an int8 cache's
 * minimums' share), into out's row at `at` */
static inline void store_sums(const float *acc, float add, float sum, int64_t d, void *out, int q_dtype, int64_t at) {
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                  second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f), added = _mm512_set1_ps(add);
    float result[MAX_CHUNK_HEAD_DIM];
    for (int64_t c = 0; c < d / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
        _mm512_storeu_ps(result + 32 * c, _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(lo, first16, hi), added), inv));
        _mm512_storeu_ps(result + 32 * c + 16,
                         _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(lo, second16, hi), added), inv));
    }
    store_row(out, q_dtype, at, d, result);
}

/* a query as bfloat16 (q_dtype's row at `at`): a float32 one as its rounding and the rounding of the rest;
 * its sum (for an int8 cache's minimums) into *total where total is not NULL */
static inline void bf16_query(const void *q, int q_dtype, int64_t at, int64_t d, uint16_t *query, uint16_t *rest,
                              float *total) {
    float sum = 0.f;
    if (q_dtype == DT_BF16) {
        memcpy(query, (const uint16_t *)q + at, (size_t)d * sizeof(uint16_t));
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < d; ++i) sum += bf16_to_f32(query[i]);
        if (total) *total = sum;
        return;
    }
    const float *qf = (const float *)q + at;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < d; ++i) {
        query[i] = f32_to_bf16(qf[i]);
        rest[i] = f32_to_bf16(qf[i] - bf16_to_f32(query[i]));
        sum += qf[i];
    }
    if (total) *total = sum;
}

/* Scores of vectors [first, first + QK_BLOCK) against the key tile, merged into their running softmax:
 * the tile's weights (bfloat16 pairs) into s->w and the factor that rescales their V sums into s->rescale
 * (1 and no weight where nothing of the tile is visible to a vector). */
static inline __attribute__((always_inline)) void score_block_bf16(bf16_scratch *s, int64_t first, int64_t d,
                                                                    int64_t j0, const int64_t *pos, int64_t window,
                                                                    float scale, int split, int kv8) {
    __m512 even[QK_BLOCK], odd[QK_BLOCK]; /* two sums a vector, so that each waits on half as many */
    for (int v = 0; v < QK_BLOCK; ++v) even[v] = odd[v] = _mm512_setzero_ps();
    if (split) {
        for (int64_t p = 0; p < d / 2; ++p) {
            const __m512bh k = (__m512bh)s->kt[p];
            for (int v = 0; v < QK_BLOCK; ++v) {
                even[v] = _mm512_dpbf16_ps(even[v], k, (__m512bh)_mm512_set1_epi32((int32_t)s->q[first + v][p]));
                odd[v] = _mm512_dpbf16_ps(odd[v], k, (__m512bh)_mm512_set1_epi32((int32_t)s->q_rest[first + v][p]));
            }
        }
    } else {
        for (int64_t p = 0; p < d / 2; p += 2) {
            const __m512bh k0 = (__m512bh)s->kt[p], k1 = (__m512bh)s->kt[p + 1];
            for (int v = 0; v < QK_BLOCK; ++v) {
                even[v] = _mm512_dpbf16_ps(even[v], k0, (__m512bh)_mm512_set1_epi32((int32_t)s->q[first + v][p]));
                odd[v] = _mm512_dpbf16_ps(odd[v], k1, (__m512bh)_mm512_set1_epi32((int32_t)s->q[first + v][p + 1]));
            }
        }
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int v = 0; v < QK_BLOCK; ++v) {
        const int64_t vec = first + v;
        __m512 score = _mm512_add_ps(even[v], odd[v]);
        if (kv8) /* the codes' sum, times each key's scale, plus its minimum times the query's sum */
            score = _mm512_fmadd_ps(score, _mm512_loadu_ps(s->k_scale),
                                    _mm512_mul_ps(_mm512_loadu_ps(s->k_low), _mm512_set1_ps(s->q_sum[vec])));
        score = _mm512_mul_ps(score, _mm512_set1_ps(scale));
        /* visible: j0 + jj <= pos and (no window or j0 + jj > pos - window) */
        const __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int32_t)j0), lanes);
        __mmask16 keep = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32((int32_t)pos[v]));
        if (window > 0) keep &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32((int32_t)(pos[v] - window)));
        if (!keep) {
            s->rescale[vec] = 1.f;
            memset(s->w[vec], 0, sizeof s->w[vec]);
            continue;
        }
        const float top_tile = _mm512_mask_reduce_max_ps(keep, score);
        const float top = s->top[vec] > top_tile ? s->top[vec] : top_tile;
        s->rescale[vec] = s->top[vec] == -INFINITY ? 0.f : fast_exp(s->top[vec] - top);
        s->top[vec] = top;
        float e[KEYS];
        _mm512_storeu_ps(e, _mm512_sub_ps(score, _mm512_set1_ps(top)));
#pragma omp simd
        for (int jj = 0; jj < KEYS; ++jj) e[jj] = fast_exp(e[jj]);
        const __m512 weights = _mm512_maskz_mov_ps(keep, _mm512_loadu_ps(e));
        if (kv8) { /* the codes' weights: each weight times its row's scale; the minimums' share apart */
            _mm256_storeu_si256((__m256i *)s->w[vec],
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(weights, _mm512_loadu_ps(s->v_scale))));
            s->low_share[vec] = s->low_share[vec] * s->rescale[vec] +
                                _mm512_reduce_add_ps(_mm512_mul_ps(weights, _mm512_loadu_ps(s->v_low)));
            s->sum[vec] = s->sum[vec] * s->rescale[vec] + _mm512_reduce_add_ps(weights);
            continue;
        }
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(weights);
        _mm256_storeu_si256((__m256i *)s->w[vec], rounded);
        const __m512 as_float = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
        s->sum[vec] = s->sum[vec] * s->rescale[vec] + _mm512_reduce_add_ps(as_float);
    }
}

/* V sums of `count` vectors from `first` (SUMS registers each: D / 16) times the tile's weights */
static inline __attribute__((always_inline)) void weigh_values_bf16(bf16_scratch *s, int64_t first, int count,
                                                                     int sums) {
    __m512 acc[PV_SUMS];
    for (int v = 0; v < count; ++v) {
        const __m512 rescale = _mm512_set1_ps(s->rescale[first + v]);
        for (int t = 0; t < sums; ++t) acc[v * sums + t] = _mm512_mul_ps(s->acc[first + v][t], rescale);
    }
    for (int jp = 0; jp < KEYS / 2; ++jp) {
        __m512bh w[PV_SUMS];
        for (int v = 0; v < count; ++v) w[v] = (__m512bh)_mm512_set1_epi32((int32_t)s->w[first + v][jp]);
        for (int t = 0; t < sums; ++t) {
            const __m512bh values = (__m512bh)s->vt[jp][t];
            for (int v = 0; v < count; ++v) acc[v * sums + t] = _mm512_dpbf16_ps(acc[v * sums + t], values, w[v]);
        }
    }
    for (int v = 0; v < count; ++v)
        for (int t = 0; t < sums; ++t) s->acc[first + v][t] = acc[v * sums + t];
}

static inline __attribute__((always_inline)) void run_task_bf16_d(const void *q, int q_dtype, int64_t hq, int64_t d,
                                                                   const void *k_cache, const void *v_cache,
                                                                   int cache_dtype, int64_t block_size, int64_t hkv,
                                                                   const int32_t *query_start, const int32_t *query_len,
                                                                   const int32_t *seq_len, const int32_t *tables,
                                                                   int64_t table_width, int64_t window, float scale,
                                                                   void *out, chunk_task task, bf16_scratch *s) {
    const int64_t group = hq / hkv, n = query_len[task.seq], length = seq_len[task.seq];
    const int64_t vectors = task.count * group, first_pos = length - n + task.first, sums = d / 16;
    const int64_t padded = (vectors + QK_BLOCK - 1) / QK_BLOCK * QK_BLOCK; /* the padding repeats the last row */
    const int per_pass = (int)(PV_SUMS / sums);
    const int32_t *table = tables + (int64_t)task.seq * table_width;
    int64_t pos[MAX_VECTORS + QK_BLOCK];
    for (int64_t vec = 0; vec < padded; ++vec) {
        const int64_t real = vec < vectors ? vec : vectors - 1;
        pos[vec] = first_pos + real / group;
        bf16_query(q, q_dtype, vector_at(query_start, task, real, group, hq, d), d, (uint16_t *)s->q[vec],
                   (uint16_t *)s->q_rest[vec], &s->q_sum[vec]);
        s->low_share[vec] = 0.f;
        for (int64_t t = 0; t < sums; ++t) s->acc[vec][t] = _mm512_setzero_ps();
        s->top[vec] = -INFINITY, s->sum[vec] = 0.f;
    }
    const int64_t last = first_pos + task.count - 1;
    for (int64_t j0 = first_key_tile(first_pos, window, KEYS); j0 <= last; j0 += KEYS) {
        load_keys_bf16(k_cache, v_cache, cache_dtype, table, block_size, hkv, task.head, d, j0, last, s);
        for (int64_t vec = 0; vec < padded; vec += QK_BLOCK)
            score_block_bf16(s, vec, d, j0, pos + vec, window, scale, q_dtype == DT_F32, cache_dtype == DT_KV8);
        for (int64_t vec = 0; vec < vectors; vec += per_pass) {
            const int count = vectors - vec < per_pass ? (int)(vectors - vec) : per_pass;
            if (count == per_pass) weigh_values_bf16(s, vec, per_pass, (int)sums); /* constant counts: sums in registers */
            else for (int v = 0; v < count; ++v) weigh_values_bf16(s, vec + v, 1, (int)sums);
        }
    }
    for (int64_t vec = 0; vec < vectors; ++vec)
        store_sums((const float *)s->acc[vec], s->low_share[vec], s->sum[vec], d, out, q_dtype,
                   vector_at(query_start, task, vec, group, hq, d));
}

static void run_task_bf16(const void *q, int q_dtype, int64_t hq, int64_t d, const void *k_cache, const void *v_cache,
                          int cache_dtype, int64_t block_size, int64_t hkv, const int32_t *query_start, const int32_t *query_len,
                          const int32_t *seq_len, const int32_t *tables, int64_t table_width, int64_t window,
                          float scale, void *out, chunk_task task, bf16_scratch *s) {
#define TASK(D) run_task_bf16_d(q, q_dtype, hq, D, k_cache, v_cache, cache_dtype, block_size, hkv, query_start, query_len, seq_len, \
                                tables, table_width, window, scale, out, task, s)
    if (d == 64) TASK(64);
    else TASK(128);
#undef TASK
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same attention on the AMX tiles (the amx-bf16 build, a bfloat16 cache, heads of 64 or 128, where
 * Linux granted the tiles): tasks of up to AMX_VECTORS query vectors, in tiles of 16, and key tiles of
 * AMX_KEYS. A vector tile's scores against a key tile are `tdpbf16ps` products of its queries (a float32
 * query as its bfloat16 rounding plus the rounding of the rest, as in run_task_bf16; 32 dimensions a
 * product, in order, the rest's product after the rounding's) by the keys' pairs, transposed once a key
 * tile for every vector tile of the task (the B tiles of run_task_bf16's kt). The scores leave the tiles
 * for the softmax recurrence (the scale, the mask, the running maximum and sum, e^x as fast_exp, the
 * weights rounded to bfloat16, as run_task_bf16), and the weights go back as one A tile that multiplies
 * the values' pairs (vt's interleaved layout) into float32 tiles: V sums from zero for the key tile, added
 * to the running ones after their rescale. A row's results depend on its query, its keys and the key
 * tiles' bounds (multiples of AMX_KEYS), never on the other rows of its tile, task or chunk, so a row's
 * sums run in the same order in any chunk; not run_task_bf16's order (the tiles sum their products in
 * their own order), so the two loops are not bit for bit the same. */
#define AMX_KEYS 32
#define AMX_VECTORS 128 /* query vectors a task: AMX_VECTORS / G rows */
#define AMX_MAX_D 128

typedef struct {
    uint16_t q[2][AMX_VECTORS][AMX_MAX_D]; /* each vector's bfloat16 query and a float32 query's rest */
    float acc[AMX_VECTORS][AMX_MAX_D];     /* V sums, each 32 outputs in vt's lane order (lo then hi) */
    float top[AMX_VECTORS], sum[AMX_VECTORS];
    uint32_t kt[2][AMX_MAX_D / 2][16];     /* B tiles of scores: [key half][pair][key] */
    uint32_t vt[AMX_MAX_D / 16][16][16];   /* B tiles of values: [16 outputs][key pair][output lane] */
    float scores[AMX_ROWS][AMX_KEYS];
    uint16_t weights[AMX_ROWS][AMX_KEYS];  /* the A tile of a vector tile's softmax weights */
    float rescale[AMX_ROWS];
    float sums[2][AMX_ROWS][16];           /* a key tile's V sums of 32 outputs */
} amx_scratch;

/* key tile [j0, j0 + AMX_KEYS) of KV head `head` into s->kt and s->vt (positions past `last`: zero) */
static void amx_load_keys(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int64_t block_size,
                          int64_t hkv, int64_t head, int64_t d, int64_t j0, int64_t last, amx_scratch *s) {
    const uint16_t *k[AMX_KEYS], *v[AMX_KEYS];
    key_rows(k_cache, v_cache, table, block_size, hkv, head, d, j0, last, AMX_KEYS, k, v);
    for (int half = 0; half < 2; ++half) transposed_pairs(k + 16 * half, d, (__m512i *)s->kt[half]);
    interleaved_values(v, AMX_KEYS / 2, d, (__m512i *)s->vt[0][0], 1, 16);
}

/* The softmax recurrence of the 16 vectors from `first` over the key tile's scores (in s->scores): their
 * weights into s->weights and the factors of their running V sums into s->rescale */
static void amx_softmax(amx_scratch *s, int64_t first, int64_t j0, const int64_t *pos, int64_t window, float scale) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < AMX_ROWS; ++i) {
        const int64_t vec = first + i;
        __m512 score[2];
        __mmask16 keep[2];
        const int every_key = j0 + AMX_KEYS - 1 <= pos[i] && (window <= 0 || j0 > pos[i] - window);
        for (int half = 0; half < 2; ++half) {
            score[half] = _mm512_mul_ps(_mm512_load_ps(s->scores[i] + 16 * half), _mm512_set1_ps(scale));
            if (every_key) {
                keep[half] = (__mmask16)0xffff;
                continue;
            }
            const __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(j0 + 16 * half)), lanes);
            keep[half] = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32((int32_t)pos[i]));
            if (window > 0) keep[half] &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32((int32_t)(pos[i] - window)));
        }
        if (!keep[0] && !keep[1]) {
            s->rescale[i] = 1.f;
            memset(s->weights[i], 0, sizeof s->weights[i]);
            continue;
        }
        const __m512 lowest = _mm512_set1_ps(-INFINITY);
        const float top_tile = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(lowest, keep[0], score[0]),
                                                                  _mm512_mask_mov_ps(lowest, keep[1], score[1])));
        const float top = s->top[vec] > top_tile ? s->top[vec] : top_tile;
        /* fast_exp(0) is 1 exactly: no call where the maximum stays */
        s->rescale[i] = s->top[vec] == -INFINITY ? 0.f : s->top[vec] == top ? 1.f : fast_exp(s->top[vec] - top);
        s->top[vec] = top;
        float e[AMX_KEYS];
        _mm512_storeu_ps(e, _mm512_sub_ps(score[0], _mm512_set1_ps(top)));
        _mm512_storeu_ps(e + 16, _mm512_sub_ps(score[1], _mm512_set1_ps(top)));
#pragma omp simd
        for (int jj = 0; jj < AMX_KEYS; ++jj) e[jj] = fast_exp(e[jj]);
        __m512 total = _mm512_setzero_ps();
        for (int half = 0; half < 2; ++half) {
            const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep[half], e + 16 * half));
            _mm256_storeu_si256((__m256i *)(s->weights[i] + 16 * half), rounded);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
        }
        s->sum[vec] = s->sum[vec] * s->rescale[i] + _mm512_reduce_add_ps(total);
    }
}

/* One key tile for the 16 vectors from `first`: scores, softmax, V sums */
static void amx_attend_tile(amx_scratch *s, int64_t first, int64_t d, int64_t j0, const int64_t *pos,
                            int64_t window, float scale, int split) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t t = 0; t < d / 32; ++t) { /* 32 dimensions (16 pairs) a product */
        _tile_loadd(4, s->q[0][first] + 32 * t, AMX_MAX_D * 2);
        _tile_loadd(6, s->kt[0][16 * t], 64);
        _tile_loadd(7, s->kt[1][16 * t], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (split) {
            _tile_loadd(5, s->q[1][first] + 32 * t, AMX_MAX_D * 2);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
        }
    }
    _tile_stored(0, s->scores[0], AMX_KEYS * 4);
    _tile_stored(1, s->scores[0] + 16, AMX_KEYS * 4);
    amx_softmax(s, first, j0, pos, window, scale);
    _tile_loadd(4, s->weights[0], AMX_KEYS * 2);
    for (int64_t c = 0; c < d / 32; ++c) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(6, s->vt[2 * c][0], 64);
        _tile_loadd(7, s->vt[2 * c + 1][0], 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
        _tile_stored(2, s->sums[0][0], 64);
        _tile_stored(3, s->sums[1][0], 64);
        for (int i = 0; i < AMX_ROWS; ++i) {
            float *acc = s->acc[first + i] + 32 * c;
            const __m512 rescale = _mm512_set1_ps(s->rescale[i]);
            _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_load_ps(acc), rescale, _mm512_load_ps(s->sums[0][i])));
            _mm512_store_ps(acc + 16, _mm512_fmadd_ps(_mm512_load_ps(acc + 16), rescale, _mm512_load_ps(s->sums[1][i])));
        }
    }
}

static void run_task_amx(const void *q, int q_dtype, int64_t hq, int64_t d, const uint16_t *k_cache,
                         const uint16_t *v_cache, int64_t block_size, int64_t hkv, const int32_t *query_start,
                         const int32_t *query_len, const int32_t *seq_len, const int32_t *tables, int64_t table_width,
                         int64_t window, float scale, void *out, chunk_task task, amx_scratch *s) {
    const int64_t group = hq / hkv, n = query_len[task.seq], length = seq_len[task.seq];
    const int64_t vectors = task.count * group, first_pos = length - n + task.first;
    const int64_t padded = (vectors + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; /* the padding repeats the last row */
    const int split = q_dtype == DT_F32;
    const int32_t *table = tables + (int64_t)task.seq * table_width;
    int64_t pos[AMX_VECTORS];
    for (int64_t vec = 0; vec < padded; ++vec) {
        const int64_t real = vec < vectors ? vec : vectors - 1;
        pos[vec] = first_pos + real / group;
        bf16_query(q, q_dtype, vector_at(query_start, task, real, group, hq, d), d, s->q[0][vec], s->q[1][vec], NULL);
        memset(s->acc[vec], 0, (size_t)d * sizeof(float));
        s->top[vec] = -INFINITY, s->sum[vec] = 0.f;
    }
    const int64_t last = first_pos + task.count - 1;
    for (int64_t j0 = first_key_tile(first_pos, window, AMX_KEYS); j0 <= last; j0 += AMX_KEYS) {
        amx_load_keys(k_cache, v_cache, table, block_size, hkv, task.head, d, j0, last, s);
        for (int64_t vec = 0; vec < padded; vec += AMX_ROWS)
            if (j0 <= pos[vec + AMX_ROWS - 1]) /* a tile past every row's position adds nothing */
                amx_attend_tile(s, vec, d, j0, pos + vec, window, scale, split);
    }
    for (int64_t vec = 0; vec < vectors; ++vec)
        store_sums(s->acc[vec], 0.f, s->sum[vec], d, out, q_dtype, vector_at(query_start, task, vec, group, hq, d));
}
#endif

/* q, out [T, Hq, D] (float32 or bfloat16); caches [num_blocks, block_size, Hkv, D]; per sequence
 * query_start, query_len, seq_len (int32) and a row of tables [seqs, table_width] (int32). Only the
 * chunk sequences' rows of out are written. */
int core_chunk_attention(const void *q, int q_dtype, int64_t hq, int64_t d, const void *k_cache,
                         const void *v_cache, int cache_dtype, int64_t block_size, int64_t hkv, int64_t seqs,
                         const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len,
                         const int32_t *tables, int64_t table_width, int64_t window, float scale, void *out) {
    if (seqs < 0 || hkv <= 0 || hq % hkv || hq / hkv > MAX_CHUNK_GROUP || d <= 0 || d > MAX_CHUNK_HEAD_DIM ||
        block_size <= 0 || (q_dtype != DT_F32 && q_dtype != DT_BF16) ||
        (cache_dtype != DT_F32 && cache_dtype != DT_BF16 && cache_dtype != DT_KV8))
        return ERR_ARGS;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int on_tiles = cache_dtype == DT_BF16 && (d == 64 || d == 128) && core_packed_uses_amx();
    const int64_t most_vectors = on_tiles ? AMX_VECTORS : MAX_VECTORS;
#else
    const int64_t most_vectors = MAX_VECTORS;
#endif
    const int64_t group = hq / hkv, rows_per_task = group >= most_vectors ? 1 : most_vectors / group;
    int64_t count = 0;
    for (int64_t s = 0; s < seqs; ++s) {
        if (query_len[s] < 0 || query_len[s] > seq_len[s]) return ERR_ARGS;
        count += (query_len[s] + rows_per_task - 1) / rows_per_task * hkv;
    }
    chunk_task *tasks = malloc((size_t)(count + 1) * sizeof(chunk_task));
    if (!tasks) return ERR_MEMORY;
    int64_t t = 0;
    for (int64_t s = 0; s < seqs; ++s) /* the longest contexts first: dynamic scheduling evens the rest out */
        for (int64_t first = (query_len[s] - 1) / rows_per_task * rows_per_task; first >= 0; first -= rows_per_task)
            for (int64_t head = 0; head < hkv; ++head) {
                const int64_t left = query_len[s] - first;
                tasks[t++] = (chunk_task){(int32_t)s, (int32_t)head, (int32_t)first,
                                          (int32_t)(left < rows_per_task ? left : rows_per_task)};
            }
    int status = OK;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int in_bf16 = (cache_dtype == DT_BF16 || cache_dtype == DT_KV8) && (d == 64 || d == 128);
    const size_t scratch_bytes = on_tiles ? sizeof(amx_scratch) : in_bf16 ? sizeof(bf16_scratch) : sizeof(chunk_scratch);
#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int in_bf16 = (cache_dtype == DT_BF16 || cache_dtype == DT_KV8) && (d == 64 || d == 128);
    const size_t scratch_bytes = in_bf16 ? sizeof(bf16_scratch) : sizeof(chunk_scratch);
#else
    const size_t scratch_bytes = sizeof(chunk_scratch);
#endif
#pragma omp parallel if (count > 1)
    {
        void *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            status = ERR_MEMORY;
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (on_tiles) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i) {
            if (!scratch) continue;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (on_tiles) {
                run_task_amx(q, q_dtype, hq, d, k_cache, v_cache, block_size, hkv, query_start, query_len, seq_len,
                             tables, table_width, window, scale, out, tasks[i], scratch);
                continue;
            }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
            if (in_bf16) {
                run_task_bf16(q, q_dtype, hq, d, k_cache, v_cache, cache_dtype, block_size, hkv, query_start, query_len,
                              seq_len, tables, table_width, window, scale, out, tasks[i], scratch);
                continue;
            }
#endif
            run_task(q, q_dtype, hq, d, k_cache, v_cache, cache_dtype, block_size, hkv, query_start, query_len,
                     seq_len, tables, table_width, window, scale, out, tasks[i], scratch);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (on_tiles) _tile_release();
#endif
        free(scratch);
    }
    free(tasks);
    return status;
}
