/* A sparse mixture-of-experts block in one call (models/sparse_moe.py's SparseMoeBlock, native/expert_mix.py): the
 * router picks each token's top_k experts (SwiGLU MLPs of packed weights), they run on its row, and their outputs,
 * each times the token's weight for that expert, are summed expert by expert in ascending index order, as
 * transformers sums them; a shared expert's output (times its sigmoid gate) is added last.
 *
 * mix_experts does the experts in Python with a dozen torch ops and three kernel calls an expert (~60 us an expert:
 * at eight experts of 128 a token, 0.5-2 ms a layer of a decode step, more than the weights take to read at one row
 * of a small MoE). Here the (token, slot) pairs are sorted by expert once (a counting sort, stable: each expert's
 * tokens in ascending order), each expert's rows gathered, multiplied by its gate_up weight, silu * up, by its down
 * weight, and added into the output: part = round(down * weight) and out = round(out + part) in the activations'
 * dtype, in the same order as mix_experts, with the same kernels on the same rows (a row's product does not depend
 * on the other rows of a call), so that core_moe_mix's results are mix_experts' bits (given the same routing).
 *
 * Where a step has at least two experts' rows a thread (a decode step: eight experts for one token), the experts are
 * shared among the threads, each running whole experts on its own (the products split no further), and the sums
 * follow in expert order: one fork and join a block where the kernels' own splits met at a barrier in every
 * product (two an expert). The bits are the same either way.
 *
 * core_moe_block also routes (core_moe_route: the router's logits, softmax, top_k, renormalized), in C for the
 * module path and the native decode stack alike, so that both give the same bits.
 *
 * A token's rows take the loop its row takes in the step (`tiled`: the prompt loop for a prompt token's rows,
 * native/tile_rows.py; NULL: the VNNI loop for all), by common.h's packed_gated and packed_product as the decoder
 * stack's layers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Routing work (tokens x experts x hidden) from which the tokens are split among the threads */
#define ROUTE_PARALLEL_MIN (1 << 20)
/* The most bytes of expert outputs the expert-parallel mix keeps at once (every pair's row until the sums); a
 * larger step (a long prompt chunk) takes the experts one after another, each product split among the threads */
#define PARALLEL_MIX_MAX_BYTES (32 << 20)

static inline float round_to(int dtype, float v) { return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void store_value(void *dst, int dtype, int64_t i, float v) {
    if (dtype == DT_BF16) ((uint16_t *)dst)[i] = f32_to_bf16(v);
    else ((float *)dst)[i] = v;
}

/* x . w over n values (w a row of the activations' dtype), in float32 */
static float dot(const float *x, const void *w, int dtype, int64_t n) {
    float sum = 0.f;
    if (dtype == DT_BF16) {
        const uint16_t *v = (const uint16_t *)w;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) sum += x[i] * bf16_to_f32(v[i]);
    } else {
        const float *v = (const float *)w;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) sum += x[i] * v[i];
    }
    return sum;
}

/* the indices of the k largest of v[0..n) into best, largest first (ties: the lower index first, NaN never above a
 * number), `taken` n bytes of scratch */
static void top_k(const float *v, int64_t n, int64_t k, uint8_t *taken, int64_t *best) {
    memset(taken, 0, (size_t)n);
    for (int64_t s = 0; s < k; ++s) {
        int64_t pick = -1;
        for (int64_t e = 0; e < n; ++e)
            if (!taken[e] && (pick < 0 || v[e] > v[pick])) pick = e;
        taken[pick] = 1;
        best[s] = pick;
    }
}

/* v[0..n) <- softmax(v), in float32 */
static void softmax(float *v, int64_t n) {
    float top = v[0], sum = 0.f;
    for (int64_t i = 1; i < n; ++i) top = v[i] > top ? v[i] : top;
    for (int64_t i = 0; i < n; ++i) sum += v[i] = expf(v[i] - top);
    for (int64_t i = 0; i < n; ++i) v[i] /= sum;
}

typedef struct {
    const core_moe *moe;
    const void *x;
    int dtype;
    int64_t tokens, hidden;
    void *weights;
    int64_t *chosen;
    int status;
} route_job;

static void route_body(void *ctx, int64_t thread, int64_t threads) {
    route_job *job = ctx;
    const core_moe *moe = job->moe;
    const int64_t h = job->hidden, experts = moe->experts, k = moe->top_k;
    int64_t begin, end;
    team_share(job->tokens, thread, threads, &begin, &end);
    float *row = malloc((size_t)(h + experts + k) * sizeof(float));
    uint8_t *taken = malloc((size_t)experts);
    if (!row || !taken) {
        team_fail(&job->status, ERR_MEMORY);
        begin = end;
    }
    float *logits = row + h, *picked = logits + experts;
    const int64_t size = job->dtype == DT_F32 ? 4 : 2;
    for (int64_t t = begin; t < end; ++t) {
        load_row(job->x, job->dtype, t * h, h, row);
        for (int64_t e = 0; e < experts; ++e) /* F.linear in the activations' dtype, then .float() */
            logits[e] = round_to(job->dtype, dot(row, (const char *)moe->router + e * h * size, job->dtype, h) +
                                                 (moe->router_bias ? moe->router_bias[e] : 0.f));
        int64_t *best = job->chosen + t * k;
        if (moe->softmax_of_top_k) {
            top_k(logits, experts, k, taken, best);
            for (int64_t s = 0; s < k; ++s) picked[s] = logits[best[s]];
            softmax(picked, k);
        } else {
            softmax(logits, experts);
            top_k(logits, experts, k, taken, best);
            float sum = 0.f;
            for (int64_t s = 0; s < k; ++s) sum += picked[s] = logits[best[s]];
            if (moe->normalize)
                for (int64_t s = 0; s < k; ++s) picked[s] /= sum;
        }
        for (int64_t s = 0; s < k; ++s) store_value(job->weights, job->dtype, t * k + s, picked[s]);
    }
    free(row);
    free(taken);
}

/* Each token's top_k experts (chosen [T, top_k], the best first) and their weights (weights [T, top_k] of x's dtype),
 * as SparseMoeBlock.routing: the router's logits in the activations' dtype, then the softmax of all of them (float32),
 * its top_k, renormalized where `normalize`; or (softmax_of_top_k) the softmax of the top_k logits alone. */
static int route(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden, void *weights,
                 int64_t *chosen) {
    route_job job = {moe, x, dtype, tokens, hidden, weights, chosen, OK};
    run_team(tokens * moe->experts * hidden >= ROUTE_PARALLEL_MIN && tokens > 1, route_body, &job);
    return job.status;
}

/* out[t] = round(out[t] + round(y[j] * weight)) for each row j of a group's rows (token t of pair t * top_k + s) */
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

/* y [count, hidden] = the SwiGLU MLP (gate_up, down) of the rows x[pairs[j] / top_k]; `scratch` holds count rows of
 * hidden + 3 inter values. On the calling thread's team: its own, or the thread alone inside a parallel region. */
static int mlp_rows(const core_packed *gate_up, const core_packed *down, const void *x, int dtype, int64_t hidden,
                    int64_t inter, const int64_t *pairs, int64_t count, int64_t top_k, int on_tiles, char *scratch,
                    char *y) {
    const int64_t size = dtype == DT_F32 ? 4 : 2;
    char *rows = scratch, *gate_up_out = rows + count * hidden * size, *act = gate_up_out + count * 2 * inter * size;
    for (int64_t j = 0; j < count; ++j)
        memcpy(rows + j * hidden * size, (const char *)x + pairs[j] / top_k * hidden * size, (size_t)(hidden * size));
    int status = packed_gated(gate_up, rows, dtype, count, hidden, on_tiles && gate_up->bits != 16, ACT_SILU,
                              gate_up_out, act);
    return status != OK ? status : packed_product(down, act, dtype, count, inter, on_tiles && down->bits != 16, y);
}

typedef struct {
    const void *x;
    int dtype;
    int64_t hidden, top_k, inter;
    const core_packed *gate_up, *down;
    const int64_t *order, *starts, *busiest; /* busiest: the non-empty groups, the most rows first */
    int64_t groups, most;
    char *y; /* every pair's output row, in `order` */
    int64_t next; /* the next of `busiest` a thread takes */
    int status;
} mix_job;

static int run_group(const mix_job *job, int64_t g, char *scratch, char *y) {
    const int64_t first = job->starts[g], count = job->starts[g + 1] - first, e = g / 2;
    return mlp_rows(job->gate_up + e, job->down + e, job->x, job->dtype, job->hidden, job->inter, job->order + first,
                    count, job->top_k, g % 2, scratch, y);
}

/* expert-parallel: each thread runs whole groups (the busiest first) into their rows of y */
static void groups_body(void *ctx, int64_t thread, int64_t threads) {
    (void)thread, (void)threads;
    mix_job *job = ctx;
    const int64_t size = job->dtype == DT_F32 ? 4 : 2;
    char *scratch = malloc((size_t)(job->most * (job->hidden + 3 * job->inter) * size));
    if (!scratch) team_fail(&job->status, ERR_MEMORY);
    for (;;) {
        const int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (!scratch || i >= job->groups || __atomic_load_n(&job->status, __ATOMIC_RELAXED) != OK) break;
        const int64_t g = job->busiest[i];
        const int status = run_group(job, g, scratch, job->y + job->starts[g] * job->hidden * size);
        if (status != OK) team_fail(&job->status, status);
    }
    free(scratch);
}

/* the non-empty groups into `busiest`, the most rows first (insertion sort: at most 2 x experts); their count */
static int64_t busiest_groups(const int64_t *starts, int64_t groups, int64_t *busiest) {
    int64_t count = 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = starts[g + 1] - starts[g];
        if (rows == 0) continue;
        int64_t i = count++;
        for (; i > 0 && starts[busiest[i - 1] + 1] - starts[busiest[i - 1]] < rows; --i) busiest[i] = busiest[i - 1];
        busiest[i] = g;
    }
    return count;
}

/* out [T, H] = the sum over each token's chosen[t, :] experts, in ascending expert order, of round(expert(x[t]) *
 * weights[t, s]) (see the file's comment) */
static int mix(const void *x, int dtype, int64_t tokens, int64_t hidden, int64_t top_k, const int64_t *chosen,
               const void *weights, const uint8_t *tiled, int64_t experts, const core_packed *gate_up,
               const core_packed *down, int64_t inter, void *out) {
    const int64_t size = dtype == DT_F32 ? 4 : 2, groups = 2 * experts;
    memset(out, 0, (size_t)(tokens * hidden * size));
    if (tokens == 0) return OK;
    for (int64_t e = 0; e < experts; ++e)
        if (gate_up[e].n != 2 * inter || gate_up[e].kp < hidden || down[e].n != hidden || down[e].kp < inter)
            return ERR_ARGS;
    int status = OK;
    int64_t *starts = malloc((size_t)(2 * groups + 1) * sizeof(int64_t)), *busiest = starts ? starts + groups + 1 : NULL;
    if (!starts) return ERR_MEMORY;
    int64_t *order = sorted_pairs(chosen, tiled, tokens, top_k, experts, starts, &status);
    mix_job job = {x, dtype, hidden, top_k, inter, gate_up, down, order, starts, busiest, 0, 0, NULL, 0, OK};
    if (order) {
        job.groups = busiest_groups(starts, groups, busiest);
        job.most = starts[busiest[0] + 1] - starts[busiest[0]];
    }
    const int64_t threads = omp_get_max_threads(), y_bytes = tokens * top_k * hidden * size;
    const int parallel = order && core_team(1) && threads > 1 && job.groups >= 2 * threads &&
                         y_bytes <= PARALLEL_MIX_MAX_BYTES;
    char *scratch = order ? malloc((size_t)((parallel ? 0 : job.most * (hidden + 3 * inter) * size) +
                                            (parallel ? y_bytes : job.most * hidden * size))) : NULL;
    if (order && !scratch) status = ERR_MEMORY;
    if (scratch && parallel) {
        job.y = scratch;
        run_team(1, groups_body, &job);
        status = job.status;
        for (int64_t g = 0; status == OK && g < groups; ++g)
            add_weighted(job.y + starts[g] * hidden * size, dtype, hidden, order + starts[g],
                         starts[g + 1] - starts[g], top_k, weights, out);
    } else if (scratch) { /* one group after another, each product on the whole team */
        char *y = scratch + job.most * (hidden + 3 * inter) * size;
        for (int64_t g = 0; status == OK && g < groups; ++g) {
            const int64_t count = starts[g + 1] - starts[g];
            if (count == 0) continue;
            status = run_group(&job, g, scratch, y);
            if (status == OK) add_weighted(y, dtype, hidden, order + starts[g], count, top_k, weights, out);
        }
    }
    free(scratch);
    free(order);
    free(starts);
    return status;
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
    return mix(x, dtype, tokens, hidden, top_k, chosen, weights, tiled, experts, gate_up, down, inter, out);
}

static int moe_fits(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden, const void *out) {
    return moe && moe->router && moe->gate_up && moe->down && moe->experts > 0 && moe->top_k > 0 &&
           moe->top_k <= moe->experts && moe->inter > 0 && hidden > 0 && tokens >= 0 && (tokens == 0 || (x && out)) &&
           (dtype == DT_F32 || dtype == DT_BF16) &&
           (!moe->shared || (moe->shared[0].kp >= hidden && moe->shared[1].n == hidden &&
                             moe->shared[1].kp >= moe->shared[0].n / 2));
}

/* each token's weight for the shared expert's output (x's dtype): sigmoid(x . shared_gate) rounded to the dtype at
 * each step as torch rounds it, or 1 (ungated) */
static int shared_weights(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden,
                          void *gates) {
    float *row = moe->shared_gate ? malloc((size_t)hidden * sizeof(float)) : NULL;
    if (moe->shared_gate && !row) return ERR_MEMORY;
    for (int64_t t = 0; t < tokens; ++t) {
        float g = 1.f;
        if (row) {
            load_row(x, dtype, t * hidden, hidden, row);
            const float logit = round_to(dtype, dot(row, moe->shared_gate, dtype, hidden));
            g = 1.f / (1.f + expf(-logit));
        }
        store_value(gates, dtype, t, g);
    }
    free(row);
    return OK;
}

/* out += the shared expert's output times its gate: round(out + round(shared(x) * gate)), each token's row on its
 * own loop (tiled) */
static int add_shared(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden,
                      const uint8_t *tiled, void *out) {
    const int64_t size = dtype == DT_F32 ? 4 : 2, inter = moe->shared[0].n / 2;
    int64_t *rows = malloc((size_t)tokens * sizeof(int64_t));
    char *memory = malloc((size_t)(tokens * (2 * hidden + 3 * inter + 1) * size));
    int status = rows && memory ? shared_weights(moe, x, dtype, tokens, hidden, memory) : ERR_MEMORY;
    char *scratch = memory ? memory + tokens * size : NULL, *y = scratch ? scratch + tokens * (hidden + 3 * inter) * size : NULL;
    for (int on_tiles = 0; status == OK && on_tiles < 2; ++on_tiles) {
        int64_t count = 0;
        for (int64_t t = 0; t < tokens; ++t)
            if ((tiled && tiled[t]) == on_tiles) rows[count++] = t;
        if (count == 0) continue;
        status = mlp_rows(moe->shared, moe->shared + 1, x, dtype, hidden, inter, rows, count, 1, on_tiles, scratch, y);
        if (status == OK) add_weighted(y, dtype, hidden, rows, count, 1, memory, out);
    }
    free(rows);
    free(memory);
    return status;
}

/* out [T, H] = the block's output for x [T, H] (float32 or bfloat16): routed (core_moe_route's choice), mixed
 * (core_moe_mix) and the shared expert added. tiled [T] (or NULL), or all_tiled: the tokens whose rows take the
 * prompt loop. */
int core_moe_block(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden, const uint8_t *tiled,
                   int all_tiled, void *out) {
    if (!moe_fits(moe, x, dtype, tokens, hidden, out)) return ERR_ARGS;
    if (tokens == 0) return OK;
    const int64_t size = dtype == DT_F32 ? 4 : 2, k = moe->top_k;
    int64_t *chosen = malloc((size_t)(tokens * k) * sizeof(int64_t));
    void *weights = malloc((size_t)(tokens * k * size));
    uint8_t *every = all_tiled ? malloc((size_t)tokens) : NULL;
    int status = chosen && weights && (every || !all_tiled) ? OK : ERR_MEMORY;
    if (every) memset(every, 1, (size_t)tokens), tiled = every;
    if (status == OK) status = route(moe, x, dtype, tokens, hidden, weights, chosen);
    if (status == OK)
        status = mix(x, dtype, tokens, hidden, k, chosen, weights, tiled, moe->experts, moe->gate_up, moe->down,
                     moe->inter, out);
    if (status == OK && moe->shared) status = add_shared(moe, x, dtype, tokens, hidden, tiled, out);
    free(chosen);
    free(weights);
    free(every);
    return status;
}

/* core_moe_block's routing alone: chosen int64 [T, top_k] (the best first) and weights [T, top_k] of x's dtype */
int core_moe_route(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden, void *weights,
                   int64_t *chosen) {
    if (!moe_fits(moe, x, dtype, tokens, hidden, weights) || (tokens > 0 && !chosen)) return ERR_ARGS;
    return tokens == 0 ? OK : route(moe, x, dtype, tokens, hidden, weights, chosen);
}
