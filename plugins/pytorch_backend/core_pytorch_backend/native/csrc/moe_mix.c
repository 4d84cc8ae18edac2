/* A sparse mixture-of-experts MLP's experts in one call (models/sparse_moe.py's mix_experts, native/expert_mix.py):
 * each token's top_k chosen experts (SwiGLU MLPs of packed weights) run on its row, and their outputs, each times the
 * token's weight for that expert, are summed expert by expert in ascending index order, as transformers sums them.
 *
 * mix_experts does it in Python with a dozen torch ops and three kernel calls an expert (~60 us an expert: at eight
 * experts of 128 a token, 0.5-2 ms a layer of a decode step, more than the weights take to read at one row of a
 * small MoE). Here the rows are sorted by expert once (a counting sort, stable: each expert's tokens in ascending
 * order), each expert's rows gathered, multiplied by its gate_up weight, silu * up, by its down weight, and added into
 * the output. The arithmetic is mix_experts' with the native ops: the same kernels on the same rows (a row's product
 * does not depend on the other rows of a call), part = round(down * weight) and out = round(out + part) in the
 * activations' dtype, in the same order, so that the results are its bits.
 *
 * A token's rows take the loop its row takes in the step (`tiled`: the prompt loop for a prompt token's rows,
 * native/tile_rows.py; NULL: the VNNI loop for all), by common.h's packed_gated and packed_product as the decoder
 * stack's layers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* out[t] = round(out[t] + round(y[j] * weight)) for each row j of an expert's rows (token t of pair t * top_k + s) */
static void add_weighted(const char *y, int dtype, int64_t hidden, const int64_t *pairs, int64_t rows,
                         int64_t top_k, const void *weights, char *out) {
    for (int64_t j = 0; j < rows; ++j) {
        const int64_t t = pairs[j] / top_k;
        if (dtype == DT_BF16) {
            const uint16_t *part = (const uint16_t *)y + j * hidden;
            uint16_t *sum = (uint16_t *)out + t * hidden;
            const float w = bf16_to_f32(((const uint16_t *)weights)[pairs[j]]);
            for (int64_t i = 0; i < hidden; ++i)
                sum[i] = f32_to_bf16(bf16_to_f32(sum[i]) + bf16_to_f32(f32_to_bf16(bf16_to_f32(part[i]) * w)));
        } else {
            const float *part = (const float *)y + j * hidden, w = ((const float *)weights)[pairs[j]];
            float *sum = (float *)out + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) {
                const float weighted = part[i] * w;
                sum[i] = sum[i] + weighted;
            }
        }
    }
}

/* The (token, slot) pairs t * top_k + s sorted by (expert, tiled), stable; starts[g] .. starts[g + 1] group g =
 * 2 expert + tiled. NULL (memory) or ERR_ARGS (an expert out of range) in *status otherwise. */
static int64_t *sorted_pairs(const int64_t *chosen, const uint8_t *tiled, int64_t tokens, int64_t top_k,
                             int64_t experts, int64_t *starts, int *status) {
    const int64_t pairs = tokens * top_k;
    int64_t *order = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof(int64_t));
    if (!order) {
        *status = ERR_MEMORY;
        return NULL;
    }
    memset(starts, 0, (size_t)(2 * experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; ++p) {
        if (chosen[p] < 0 || chosen[p] >= experts) {
            free(order);
            *status = ERR_ARGS;
            return NULL;
        }
        ++starts[2 * chosen[p] + (tiled && tiled[p / top_k]) + 1];
    }
    for (int64_t g = 0; g < 2 * experts; ++g) starts[g + 1] += starts[g];
    int64_t *next = malloc((size_t)(2 * experts) * sizeof(int64_t));
    if (!next) {
        free(order);
        *status = ERR_MEMORY;
        return NULL;
    }
    memcpy(next, starts, (size_t)(2 * experts) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; ++p) order[next[2 * chosen[p] + (tiled && tiled[p / top_k])]++] = p;
    free(next);
    return order;
}

/* out [T, H] (x's dtype, float32 or bfloat16) = the sum over each token's chosen[t, :] experts, in ascending expert
 * order, of round(expert(x[t]) * weights[t, s]); gate_up[e] ([2 inter, H]) and down[e] ([H, inter]) expert e's packed
 * weights; tiled [T] (or NULL): 1 where a token's rows take the prompt loop. */
int core_moe_mix(const void *x, int dtype, int64_t tokens, int64_t hidden, int64_t top_k, const int64_t *chosen,
                 const void *weights, const uint8_t *tiled, int64_t experts, const core_packed *gate_up,
                 const core_packed *down, int64_t inter, void *out) {
    if ((tokens > 0 && (!x || !chosen || !weights || !out)) || tokens < 0 || hidden <= 0 || top_k <= 0 ||
        experts <= 0 || inter <= 0 || !gate_up || !down || (dtype != DT_F32 && dtype != DT_BF16))
        return ERR_ARGS;
    const int64_t size = dtype == DT_F32 ? 4 : 2;
    memset(out, 0, (size_t)(tokens * hidden * size));
    if (tokens == 0) return OK;
    int status = OK;
    int64_t *starts = malloc((size_t)(2 * experts + 1) * sizeof(int64_t));
    if (!starts) return ERR_MEMORY;
    int64_t *order = sorted_pairs(chosen, tiled, tokens, top_k, experts, starts, &status);
    /* one buffer for the most rows a group has (at most T, each token choosing an expert once): its rows, their
       [gate | up] product, silu * up and the down product */
    int64_t most = 0;
    for (int64_t g = 0; order && g < 2 * experts; ++g)
        if (starts[g + 1] - starts[g] > most) most = starts[g + 1] - starts[g];
    char *rows = order ? malloc((size_t)(most * (2 * hidden + 3 * inter) * size)) : NULL;
    if (order && !rows) status = ERR_MEMORY;
    char *gate_up_out = rows ? rows + most * hidden * size : NULL, *act = gate_up_out + most * 2 * inter * size,
         *y = act + most * inter * size;
    for (int64_t g = 0; rows && status == OK && g < 2 * experts; ++g) {
        const int64_t first = starts[g], count = starts[g + 1] - first, e = g / 2;
        if (count == 0) continue;
        const int on_tiles = g % 2 && gate_up[e].bits != 16;
        if (gate_up[e].n != 2 * inter || gate_up[e].kp < hidden || down[e].n != hidden || down[e].kp < inter) {
            status = ERR_ARGS;
            break;
        }
        for (int64_t j = 0; j < count; ++j)
            memcpy(rows + j * hidden * size, (const char *)x + order[first + j] / top_k * hidden * size,
                   (size_t)(hidden * size));
        status = packed_gated(&gate_up[e], rows, dtype, count, hidden, on_tiles, ACT_SILU, gate_up_out, act);
        if (status == OK)
            status = packed_product(&down[e], act, dtype, count, inter, on_tiles && down[e].bits != 16, y);
        if (status == OK) add_weighted(y, dtype, hidden, order + first, count, top_k, weights, out);
    }
    free(rows);
    free(order);
    free(starts);
    return status;
}
