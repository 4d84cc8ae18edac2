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
 * sums run in the same order in any chunk. e^x is fast_exp (relative error ~2e-7).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "common.h"

#define KEYS 16
#define MAX_VECTORS 64 /* query vectors of one task: ROWS = MAX_VECTORS / G rows (at least 1) */
#define BLOCK 8 /* query vectors merged together (attend_block) */
#define MAX_CHUNK_HEAD_DIM 256
#define MAX_CHUNK_GROUP 64

typedef struct {
    int32_t seq, head, first, count; /* query rows first .. first + count - 1 of the sequence's chunk */
} chunk_task;

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
        const int64_t at = (slot_of(table, j0 + jj, block_size) * hkv + head) * d;
        load_row(k_cache, cache_dtype, at, d, row);
        for (int64_t i = 0; i < d; ++i) s->kt[i][jj] = row[i];
        load_row(v_cache, cache_dtype, at, d, s->v[jj]);
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
        const int64_t row = query_start[task.seq] + task.first + real / group;
        const int64_t head = task.head * group + real % group;
        pos[vec] = first_pos + real / group;
        load_row(q, q_dtype, (row * hq + head) * d, d, s->q[vec]);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) s->q[vec][i] *= scale, s->acc[vec][i] = 0.f;
        s->top[vec] = -INFINITY, s->sum[vec] = 0.f;
    }
    const int64_t last = first_pos + task.count - 1;
    int64_t lowest = window > 0 ? first_pos - window + 1 : 0;
    lowest = lowest < 0 ? 0 : lowest;
    for (int64_t j0 = lowest / KEYS * KEYS; j0 <= last; j0 += KEYS) {
        load_keys(k_cache, v_cache, cache_dtype, table, block_size, hkv, task.head, d, j0, last, s);
        for (int64_t vec = 0; vec < padded; vec += BLOCK) attend_any(s, vec, d, j0, pos + vec, window);
    }
    for (int64_t vec = 0; vec < vectors; ++vec) {
        const int64_t row = query_start[task.seq] + task.first + vec / group;
        const int64_t head = task.head * group + vec % group;
        const float inv = s->sum[vec] > 0.f ? 1.f / s->sum[vec] : 0.f;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) s->acc[vec][i] *= inv;
        store_row(out, q_dtype, (row * hq + head) * d, d, s->acc[vec]);
    }
}

/* q, out [T, Hq, D] (float32 or bfloat16); caches [num_blocks, block_size, Hkv, D]; per sequence
 * query_start, query_len, seq_len (int32) and a row of tables [seqs, table_width] (int32). Only the
 * chunk sequences' rows of out are written. */
int core_chunk_attention(const void *q, int q_dtype, int64_t hq, int64_t d, const void *k_cache,
                         const void *v_cache, int cache_dtype, int64_t block_size, int64_t hkv, int64_t seqs,
                         const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len,
                         const int32_t *tables, int64_t table_width, int64_t window, float scale, void *out) {
    if (seqs < 0 || hkv <= 0 || hq % hkv || hq / hkv > MAX_CHUNK_GROUP || d <= 0 || d > MAX_CHUNK_HEAD_DIM ||
        block_size <= 0 || (q_dtype != DT_F32 && q_dtype != DT_BF16) ||
        (cache_dtype != DT_F32 && cache_dtype != DT_BF16))
        return ERR_ARGS;
    const int64_t group = hq / hkv, rows_per_task = group >= MAX_VECTORS ? 1 : MAX_VECTORS / group;
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
#pragma omp parallel if (count > 1)
    {
        chunk_scratch *scratch = malloc(sizeof(chunk_scratch));
        if (!scratch) {
#pragma omp atomic write
            status = ERR_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; ++i)
            if (scratch)
                run_task(q, q_dtype, hq, d, k_cache, v_cache, cache_dtype, block_size, hkv, query_start, query_len,
                         seq_len, tables, table_width, window, scale, out, tasks[i], scratch);
        free(scratch);
    }
    free(tasks);
    return status;
}
