/* y[rows, out] += the LoRA term of each row's adapter, in place: one call for every adapter of a step.
 *
 * Row i uses slot s = row_slot[i] (-1: none, the row is left alone). For each shard j of the layer
 * (q, k, v of a fused projection; one shard for a plain one) and r = slot_rank[s]:
 *   h = A[s][j][:r] @ x_i                                       (r values)
 *   y_i[start_j : start_j + size_j] += h @ Bt_j[s][:r]          (B kept transposed, scaling folded in)
 * Layouts, float32 or bfloat16 (w_dtype), R = the largest rank a slot holds:
 *   a:  [slots][shards][R][in]
 *   bt: shard j at element offset slots * R * start_j, laid out [slots][R][size_j]
 * so a fused layer stores no block-diagonal zeros and a slot of rank r < R reads only its r rows.
 *
 * Rows are grouped by slot and taken LORA_TILE at a time, so that each weight row read serves them
 * all; a tile of fewer rows repeats its first row and drops the copies' results, so every row's
 * arithmetic is the same whatever the batch (the prefix cache relies on it). The (slot, tile, shard)
 * tasks write disjoint parts of y and are split among OpenMP threads (torch's libgomp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "common.h"

#define LORA_TILE 4
#define LORA_MAX_RANK 512

int core_lora_max_rank(void) { return LORA_MAX_RANK; }

/* h[t][k] = A[k] . x_t for the tile's LORA_TILE rows and k < rank */
static void shrink(const void *a, int dtype, int64_t in, int64_t rank, const float *const x[LORA_TILE],
                   float h[LORA_TILE][LORA_MAX_RANK]) {
    for (int64_t k = 0; k < rank; ++k) {
        const int64_t row = k * in;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        if (dtype == DT_BF16) {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; ++i) {
                const float w = bf16_to_f32(((const uint16_t *)a)[row + i]);
                s0 += w * x[0][i], s1 += w * x[1][i], s2 += w * x[2][i], s3 += w * x[3][i];
            }
        } else {
            const float *ak = (const float *)a + row;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; ++i) {
                const float w = ak[i];
                s0 += w * x[0][i], s1 += w * x[1][i], s2 += w * x[2][i], s3 += w * x[3][i];
            }
        }
        h[0][k] = s0, h[1][k] = s1, h[2][k] = s2, h[3][k] = s3;
    }
}

/* y_t[o] += sum_k h[t][k] Bt[k][o] for the tile's first `count` rows */
static void expand(const void *bt, int dtype, int64_t size, int64_t rank, float h[LORA_TILE][LORA_MAX_RANK],
                   float *const y[LORA_TILE], int count) {
    for (int64_t k = 0; k < rank; ++k) {
        const int64_t row = k * size;
        for (int t = 0; t < count; ++t) {
            const float hk = h[t][k];
            float *yt = y[t];
            if (dtype == DT_BF16) {
#pragma omp simd
                for (int64_t o = 0; o < size; ++o) yt[o] += hk * bf16_to_f32(((const uint16_t *)bt)[row + o]);
            } else {
                const float *bk = (const float *)bt + row;
#pragma omp simd
                for (int64_t o = 0; o < size; ++o) yt[o] += hk * bk[o];
            }
        }
    }
}

typedef struct {
    int32_t slot, shard, first, count; /* rows order[first : first + count] */
} lora_task;

int core_lora_apply(const float *x, int64_t rows, int64_t in, float *y, int64_t out, const int32_t *row_slot,
                    int64_t slots, const int32_t *slot_rank, int64_t max_rank, int64_t shards,
                    const int64_t *shard_start, const int64_t *shard_size, const void *a, const void *bt,
                    int w_dtype) {
    if (rows < 0 || in <= 0 || out <= 0 || slots <= 0 || shards <= 0 || max_rank <= 0 ||
        max_rank > LORA_MAX_RANK || (w_dtype != DT_F32 && w_dtype != DT_BF16))
        return ERR_ARGS;
    int64_t *counts = calloc((size_t)slots + 1, sizeof(int64_t));
    int64_t *order = malloc(((size_t)rows + 1) * sizeof(int64_t));
    lora_task *tasks = malloc(((size_t)rows + 1) * (size_t)shards * sizeof(lora_task));
    int status = counts && order && tasks ? OK : ERR_MEMORY;
    int64_t ntasks = 0;
    for (int64_t i = 0; status == OK && i < rows; ++i) { /* counting sort of the rows by slot */
        const int32_t s = row_slot[i];
        if (s >= slots || (s >= 0 && (slot_rank[s] < 0 || slot_rank[s] > max_rank)))
            status = ERR_ARGS;
        else if (s >= 0)
            counts[s + 1]++;
    }
    if (status == OK) {
        for (int64_t s = 0; s < slots; ++s) counts[s + 1] += counts[s];
        int64_t *fill = calloc((size_t)slots, sizeof(int64_t));
        if (!fill) status = ERR_MEMORY;
        for (int64_t i = 0; fill && i < rows; ++i)
            if (row_slot[i] >= 0) order[counts[row_slot[i]] + fill[row_slot[i]]++] = i;
        free(fill);
        for (int64_t s = 0; status == OK && s < slots; ++s)
            for (int64_t first = counts[s]; slot_rank[s] > 0 && first < counts[s + 1]; first += LORA_TILE)
                for (int64_t j = 0; j < shards; ++j) {
                    const int64_t left = counts[s + 1] - first;
                    tasks[ntasks++] = (lora_task){(int32_t)s, (int32_t)j, (int32_t)first,
                                                  (int32_t)(left < LORA_TILE ? left : LORA_TILE)};
                }
    }
    const size_t wsize = w_dtype == DT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) if (ntasks > 1)
    for (int64_t n = 0; n < ntasks; ++n) {
        const lora_task task = tasks[n];
        const float *xs[LORA_TILE];
        float *ys[LORA_TILE];
        for (int t = 0; t < LORA_TILE; ++t) {
            const int64_t row = order[task.first + (t < task.count ? t : 0)];
            xs[t] = x + row * in;
            ys[t] = y + row * out + shard_start[task.shard];
        }
        const int64_t rank = slot_rank[task.slot];
        float h[LORA_TILE][LORA_MAX_RANK];
        const char *a_sj = (const char *)a + (((int64_t)task.slot * shards + task.shard) * max_rank) * in * wsize;
        const char *bt_sj = (const char *)bt + (slots * max_rank * shard_start[task.shard] +
                                                (int64_t)task.slot * max_rank * shard_size[task.shard]) * wsize;
        shrink(a_sj, w_dtype, in, rank, xs, h);
        expand(bt_sj, w_dtype, shard_size[task.shard], rank, h, ys, task.count);
    }
    free(counts);
    free(order);
    free(tasks);
    return status;
}
