/* A decode step through every layer of a Llama-like decoder in one call: the kernels a layer's modules
 * call one by one from Python (RMSNorm with the residual add, the packed q/k/v projection, per-head
 * q/k RMSNorm, rotary, the KV-cache store, paged decode attention, the o projection, the post-attention
 * RMSNorm, the packed gate/up projection, silu * up and the down projection), called here in the same
 * order on the same buffers. The results are therefore bit for bit those of the module path
 * (models/llama.py over kernels/native.py); what goes is ~100 us a layer of Python, dispatch and
 * allocation (a third of a one-row decode step of SmolLM2-135M on a 2-core EPYC).
 *
 * Gemma's decoders (models/gemma.py, gemma2.py, gemma3.py) take the same layer with their differences as data:
 * norms of float32 weights (1 + w) multiplied in float32 (NORM_RMS_FLOAT: core_rms_norm_float), GELU-tanh * up
 * (act), norms of the attention's and the MLP's outputs before each joins the residual (Gemma 2 and 3's
 * sandwich norms: attn_out_norm, mlp_out_norm), and a rotary table per layer (Gemma 3's sliding layers have
 * their own base). Granite's (models/granite.py) multiplies what the attention and the MLP add to the residual
 * by residual_multiplier (branch_scale). OLMo 2 and 3's and EXAONE 4's post-norm layers (models/olmo2.py) have
 * only the output norms: no input_norm and no post_norm (the attention and the MLP read the residual stream as it
 * is), and OLMo's q and k norms span all heads at once (qk_norm_whole). The sparse MoE models over Llama's layer
 * (Qwen2-MoE, Qwen3-MoE, Mixtral, Granite MoE, OLMoE) have a core_moe_block (moe_mix.c) where the MLP is, routing
 * included. Gemma 2's attention soft-caps its scores (softcap, in core_decode_attention); GLM-4 has the output norms
 * beside the input ones (RMSNorms); OLMoE clamps q, k and v after its q and k norms (clip_qkv); StableLM's norms are
 * LayerNorms with biases (NORM_LAYER: core_layer_norm), and its parallel layers run the MLP on the attention's input
 * norm, both outputs joining the residual (parallel); Phi's sum the two outputs first. StarCoder 2's, Phi's,
 * Arcee's, Jais 2's and Nemotron's MLPs are ungated (ungated: core_act; relu^2: ACT_RELU2). Apertus's is xIELU
 * (ACT_XIELU, act_params). Ministral 3 scales q after rotary by a factor of its position (q_scale). NanoChat normalizes q and k
 * after rotary (qk_norm_after_rope), its weightless norms NORM_RMS_FLOAT of ones.
 *
 * The model and its layers are described once (core_decoder, core_layer: pointers into the weights and
 * KV caches, which decoder_stack.py keeps alive and rebuilds when they move); a step passes its rows.
 * Every row is a decode row (one new token attending to its paged context). hidden [T, H] holds the
 * embeddings on entry and the last layer's MLP output on return; residual [T, H] the running sum
 * (given: residual_given; else layer 0 starts it from the embeddings, as LlamaDecoderLayer does).
 */
#define _POSIX_C_SOURCE 200809L /* sched_yield */
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"

typedef struct {
    const void *input_norm, *post_norm;       /* [H] before the attention and before the MLP (see norm_kind), or
                                                 NULL (post-norm layers: the residual stream as it is) */
    const void *q_norm, *k_norm;              /* [D] (Qwen3, Gemma 3) or [Hq D], [Hkv D] (qk_norm_whole), or NULL */
    const void *attn_out_norm, *mlp_out_norm; /* [H] of the attention's and the MLP's outputs (Gemma 2, 3), or NULL */
    const void *cos, *sin;                    /* this layer's rotary table, [max_position, D / 2] of table_dtype */
    core_packed qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, Hkv, D] of the cache dtype */
    int64_t window;          /* sliding window, 0: none */
    float scale;             /* softmax scale */
    float softcap;           /* scores soft-capped (Gemma 2's attn_logit_softcapping: cpu_ops.c cap_scores), 0: not */
    int32_t rope;            /* 1: rotary on q and k; 0: none (SmolLM3's no-rope layers) */
    const core_moe *moe;     /* the MLP a sparse MoE block (moe_mix.c; gate_up and down unused), or NULL */
    const void *input_bias, *post_bias; /* [H] input_norm's and post_norm's biases (NORM_LAYER), or NULL: none */
    const void *q_scale; /* [max_position] of the activations' dtype: q times its position's factor after rotary
                            (Ministral 3's Llama 4 scaling), or NULL: none */
    float act_params[4]; /* the MLP activation's parameters (ACT_XIELU: this layer's alpha_p, alpha_n, beta, eps) */
} core_layer;

/* core_decoder.parallel: the MLP after the attention, or beside it on the attention's input norm, the attention's
 * output joining the residual as the MLP's does (StableLM's use_parallel_residual: residual + attn, then + mlp) or
 * summed with the MLP's first (Phi's: residual + (attn + mlp)) */
enum { PARALLEL_NONE = 0, PARALLEL_RESIDUAL = 1, PARALLEL_SUM = 2 };

/* core_decoder.norm_kind: every norm of the layers is one of these */
enum { NORM_RMS = 0,       /* RMSNorm, weights of the activations' dtype (core_rms_norm) */
       NORM_RMS_FLOAT = 1, /* weights float32, multiplied in float32 and rounded once (Gemma: 1 + w) */
       NORM_LAYER = 2 };   /* LayerNorm (a bias or none), weights of the activations' dtype (core_layer_norm) */

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter; /* inter: the dense MLPs' (the widest; MoE layers' own) */
    int64_t rotary_dim; /* each head's rotated values (partial_rotary_factor: fewer than head_dim; the rest as is) */
    int32_t dtype, cache_dtype, table_dtype; /* dtype: the activations' (and the norm weights', but NORM_RMS_FLOAT) */
    int32_t norm_kind;  /* NORM_RMS, NORM_RMS_FLOAT or NORM_LAYER */
    int32_t act;        /* ACT_SILU or ACT_GELU_TANH (common.h); ACT_RELU2 or ACT_XIELU for an ungated MLP */
    float branch_scale; /* multiplies what the attention and the MLP add to the residual (Granite); 1: none */
    int32_t qk_norm_whole; /* 1: q and k normalised over all their heads at once (OLMo 2, 3), 0: head by head */
    int32_t qk_norm_after_rope; /* 1: q and k normalised after rotary (NanoChat), 0: before (Qwen3, Gemma 3) */
    float eps;
    float clip_qkv;        /* q, k and v clamped to [-clip_qkv, clip_qkv] after the q and k norms (OLMoE), 0: not */
    int32_t parallel;      /* PARALLEL_*: whether the MLP reads the attention's input norm beside it (post_norm NULL) */
    int32_t ungated;       /* 1: the MLP is down(act(up x)), gate_up the up projection [inter, H] (StarCoder 2) */
    int64_t block_size, num_slots, max_position;
    int32_t tiles;         /* 1: the packed weights multiply on the AMX tiles (core_packed_linear_tiles) */
    int32_t group_rows;    /* the fewest rows of a unit of the row-group path (0: never that path) */
    int32_t group_from;    /* steps of at least this many rows take it */
} core_decoder;

/* The row-group path cuts a step into about this many groups a thread (none of fewer than group_rows
 * rows): on 2 cores 8 units a layer, which keep a thread busy while the other is taken away; at 64 rows
 * units of 8 rows read each layer's weights half as often as units of 4 (about 1% faster alone). */
#define GROUPS_PER_THREAD 4

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

static int linear(const core_decoder *m, const core_packed *w, const void *x, int64_t rows, int64_t k, void *y) {
    return packed_product(w, x, m->dtype, rows, k, m->tiles, y);
}

/* rows [T, width] `stride` elements apart from src into contiguous dst */
static void copy_rows(const char *src, int64_t stride, int64_t rows, int64_t width, int64_t size, char *dst) {
    for (int64_t t = 0; t < rows; ++t) memcpy(dst + t * width * size, src + t * stride * size, (size_t)(width * size));
}

/* The model's kind of norm (norm_kind) of `rows` rows of `width` (with `residual`: of x + residual, the sum written
 * to residual_out); `bias` a LayerNorm's (or NULL) */
static int norm(const core_decoder *m, const void *x, int64_t rows, int64_t width, const void *residual,
                const void *weight, const void *bias, void *out, void *residual_out) {
    if (m->norm_kind == NORM_LAYER)
        return core_layer_norm(x, m->dtype, rows, width, residual, weight, bias, m->dtype, m->eps, out, residual_out);
    if (m->norm_kind == NORM_RMS_FLOAT)
        return core_rms_norm_float(x, m->dtype, rows, width, residual, weight, m->eps, out, residual_out);
    return core_rms_norm(x, m->dtype, rows, width, residual, weight, m->dtype, m->eps, out, residual_out);
}

/* x [rows, width] times `scale`, rounded to the dtype (as torch multiplies a tensor by a Python float) */
static void scale_rows(const core_decoder *m, char *x, int64_t rows, int64_t width) {
    const int64_t n = rows * width;
    if (m->dtype == DT_BF16) {
        uint16_t *v = (uint16_t *)x;
        for (int64_t i = 0; i < n; ++i) v[i] = f32_to_bf16(bf16_to_f32(v[i]) * m->branch_scale);
    } else {
        float *v = (float *)x;
        for (int64_t i = 0; i < n; ++i) v[i] *= m->branch_scale;
    }
}

/* each row t of x [rows, width] times table[positions[t]] (of the dtype), rounded to the dtype (torch's q * scale) */
static int scale_by_position(const core_decoder *m, const void *table, const int64_t *positions, char *x,
                             int64_t rows, int64_t width) {
    for (int64_t t = 0; t < rows; ++t) {
        if (positions[t] < 0 || positions[t] >= m->max_position) return ERR_ARGS;
        if (m->dtype == DT_BF16) {
            uint16_t *v = (uint16_t *)x + t * width;
            const float s = bf16_to_f32(((const uint16_t *)table)[positions[t]]);
            for (int64_t i = 0; i < width; ++i) v[i] = f32_to_bf16(bf16_to_f32(v[i]) * s);
        } else {
            float *v = (float *)x + t * width;
            const float s = ((const float *)table)[positions[t]];
            for (int64_t i = 0; i < width; ++i) v[i] *= s;
        }
    }
    return OK;
}

/* `rows` rows of `width` values `stride` apart clamped to [-m->clip_qkv, m->clip_qkv] in place (as torch's clamp:
 * compared in float32, the bound rounded to the dtype) */
static void clamp_rows(const core_decoder *m, char *x, int64_t stride, int64_t rows, int64_t width) {
    const float high = m->clip_qkv, low = -m->clip_qkv;
    for (int64_t t = 0; t < rows; ++t) {
        if (m->dtype == DT_BF16) {
            uint16_t *v = (uint16_t *)x + t * stride;
            for (int64_t i = 0; i < width; ++i) {
                const float f = bf16_to_f32(v[i]);
                v[i] = f32_to_bf16(f < low ? low : f > high ? high : f);
            }
        } else {
            float *v = (float *)x + t * stride;
            for (int64_t i = 0; i < width; ++i) v[i] = v[i] < low ? low : v[i] > high ? high : v[i];
        }
    }
}

/* residual = hidden + residual, rounded to the dtype (a post-norm layer's input: no norm) */
static void add_rows(const core_decoder *m, const char *hidden, char *residual, int64_t n) {
    if (m->dtype == DT_BF16) {
        const uint16_t *a = (const uint16_t *)hidden;
        uint16_t *r = (uint16_t *)residual;
        for (int64_t i = 0; i < n; ++i) r[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(r[i]));
    } else {
        const float *a = (const float *)hidden;
        float *r = (float *)residual;
        for (int64_t i = 0; i < n; ++i) r[i] += a[i];
    }
}

#define CHECK(call)                  \
    do {                             \
        status = (call);             \
        if (status != OK) return status; \
    } while (0)

/* The scratch buffers one layer of up to `rows` rows writes between its kernels (branch: PARALLEL_SUM's attention
 * output). */
typedef struct {
    char *memory, *normed, *qkv, *rotated, *heads, *attn, *gate_up, *act, *branch;
} layer_buffers;

static int alloc_buffers(const core_decoder *m, int64_t rows, layer_buffers *b) {
    const int64_t size = elem_size(m->dtype), h = m->hidden, q_width = m->heads * m->head_dim,
                  kv_width = m->kv_heads * m->head_dim;
    const int64_t normed_n = rows * h, qkv_n = rows * (q_width + 2 * kv_width), rot_n = rows * (q_width + kv_width),
                  heads_n = rot_n, attn_n = rows * q_width, gate_up_n = rows * 2 * m->inter, act_n = rows * m->inter,
                  branch_n = m->parallel == PARALLEL_SUM ? rows * h : 0;
    b->memory = malloc((size_t)((normed_n + qkv_n + rot_n + heads_n + attn_n + gate_up_n + act_n + branch_n) * size));
    if (!b->memory) return ERR_MEMORY;
    b->normed = b->memory;
    b->qkv = b->normed + normed_n * size;
    b->rotated = b->qkv + qkv_n * size;
    b->heads = b->rotated + rot_n * size;
    b->attn = b->heads + heads_n * size;
    b->gate_up = b->attn + attn_n * size;
    b->act = b->gate_up + gate_up_n * size;
    b->branch = b->act + act_n * size;
    return OK;
}

/* The rows of a step that one call of layer() takes: views into the step's arrays. */
typedef struct {
    int64_t count;
    char *hidden, *residual;
    const int64_t *positions, *slots;
    const int32_t *tables, *lengths;
} row_span;

static row_span span_of(const core_decoder *m, int64_t first, int64_t count, void *hidden, void *residual,
                        const int64_t *positions, const int64_t *slots, const int32_t *tables, int64_t table_width,
                        const int32_t *lengths) {
    const int64_t offset = first * m->hidden * elem_size(m->dtype);
    const row_span span = {count, (char *)hidden + offset, (char *)residual + offset, positions + first, slots + first,
                           tables + first * table_width, lengths + first};
    return span;
}

/* What the attention (or the MLP) reads: `norm` of hidden + residual, the sum left in residual (layer 0's
 * `start`: hidden itself), or with no norm the sum itself */
static int branch_input(const core_decoder *m, const void *weight, const void *bias, int start, const row_span *r,
                        char *normed, const char **input) {
    const int64_t h = m->hidden, tokens = r->count;
    if (start) memcpy(r->residual, r->hidden, (size_t)(tokens * h * elem_size(m->dtype)));
    else if (!weight) add_rows(m, r->hidden, r->residual, tokens * h);
    *input = weight ? normed : r->residual;
    if (!weight) return OK;
    return norm(m, r->hidden, tokens, h, start ? NULL : r->residual, weight, bias, normed,
                start ? NULL : r->residual);
}

/* The layer's q and k norms of contiguous q [tokens, Hq D] and k [tokens, Hkv D], in place: head by head, or over
 * all heads at once (qk_norm_whole) */
static int qk_norms(const core_decoder *m, const core_layer *L, char *q, char *k, int64_t tokens) {
    const int64_t d = m->head_dim, hq = m->heads, hkv = m->kv_heads, whole = m->qk_norm_whole;
    const int status = norm(m, q, whole ? tokens : tokens * hq, whole ? hq * d : d, NULL, L->q_norm, NULL, q, NULL);
    if (status != OK) return status;
    return norm(m, k, whole ? tokens : tokens * hkv, whole ? hkv * d : d, NULL, L->k_norm, NULL, k, NULL);
}

/* One decoder layer of the rows in `r` (start: layer 0 without a given residual, which it starts from the
 * embeddings). Each kernel runs with the OpenMP team it finds: its own when called outside a parallel
 * region, the calling thread alone inside one (the row-group path). */
static int layer(const core_decoder *m, const core_layer *L, int start, const row_span *r, int64_t table_width,
                 const layer_buffers *b) {
    const int64_t size = elem_size(m->dtype), h = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads,
                  tokens = r->count;
    const int64_t q_width = hq * d, kv_width = hkv * d, qkv_width = q_width + 2 * kv_width;
    char *q_rot = b->rotated, *k_rot = b->rotated + tokens * q_width * size;
    int status = OK;
    const char *input;
    CHECK(branch_input(m, L->input_norm, L->input_bias, start, r, b->normed, &input));
    CHECK(linear(m, &L->qkv, input, tokens, h, b->qkv));
    const char *q = b->qkv, *k = b->qkv + q_width * size, *v = b->qkv + (q_width + kv_width) * size;
    int64_t q_stride = qkv_width, k_stride = qkv_width;
    if (L->q_norm && !m->qk_norm_after_rope) { /* per-head RMSNorm of contiguous copies of q and k */
        char *qn = b->heads, *kn = b->heads + tokens * q_width * size;
        copy_rows(q, qkv_width, tokens, q_width, size, qn);
        copy_rows(k, qkv_width, tokens, kv_width, size, kn);
        CHECK(qk_norms(m, L, qn, kn, tokens));
        q = qn, k = kn, q_stride = q_width, k_stride = kv_width;
    }
    if (m->clip_qkv > 0.f) { /* q and k where they are now (the buffers of this call), v in the projection's */
        clamp_rows(m, (char *)q, q_stride, tokens, q_width);
        clamp_rows(m, (char *)k, k_stride, tokens, kv_width);
        clamp_rows(m, (char *)v, qkv_width, tokens, kv_width);
    }
    if (L->rope) {
        CHECK(core_rotary_part(q, k, m->dtype, tokens, hq, hkv, d, m->rotary_dim, q_stride, k_stride, r->positions,
                               L->cos, L->sin, m->table_dtype, m->max_position, q_rot, k_rot));
    } else { /* the same values the modules hand on unrotated, in the buffers the next kernels read */
        copy_rows(q, q_stride, tokens, q_width, size, q_rot);
        copy_rows(k, k_stride, tokens, kv_width, size, k_rot);
    }
    if (L->q_norm && m->qk_norm_after_rope) CHECK(qk_norms(m, L, q_rot, k_rot, tokens)); /* the rotated q and k */
    if (L->q_scale) CHECK(scale_by_position(m, L->q_scale, r->positions, q_rot, tokens, q_width));
    CHECK(core_store_kv(k_rot, v, m->dtype, tokens, hkv, d, kv_width, qkv_width, r->slots, L->k_cache, L->v_cache,
                        m->cache_dtype, m->num_slots));
    CHECK(core_decode_attention(q_rot, m->dtype, tokens, hq, d, L->k_cache, L->v_cache, m->cache_dtype, m->block_size,
                                hkv, r->tables, table_width, r->lengths, L->window, L->scale, L->softcap,
                                b->attn));
    const int sum = m->parallel == PARALLEL_SUM;
    char *attn_out = sum ? b->branch : r->hidden; /* summed with the MLP's output below, or joining the residual */
    CHECK(linear(m, &L->o, b->attn, tokens, q_width, attn_out));
    if (L->attn_out_norm) CHECK(norm(m, attn_out, tokens, h, NULL, L->attn_out_norm, NULL, attn_out, NULL));
    if (m->branch_scale != 1.f) scale_rows(m, attn_out, tokens, h);
    if (!sum) CHECK(branch_input(m, L->post_norm, L->post_bias, 0, r, b->normed, &input));
    if (m->parallel) input = b->normed; /* the MLP reads the attention's input norm */
    if (L->moe) {
        CHECK(core_moe_block(L->moe, input, m->dtype, tokens, h, NULL, m->tiles, r->hidden));
    } else {
        if (m->ungated) {
            CHECK(linear(m, &L->gate_up, input, tokens, h, b->act));
            CHECK(core_act(b->act, m->dtype, tokens, m->inter, m->act, L->act_params, b->act));
        } else {
            CHECK(packed_gated(&L->gate_up, input, m->dtype, tokens, h, m->tiles, m->act, b->gate_up, b->act));
        }
        CHECK(linear(m, &L->down, b->act, tokens, m->inter, r->hidden));
    }
    if (L->mlp_out_norm) CHECK(norm(m, r->hidden, tokens, h, NULL, L->mlp_out_norm, NULL, r->hidden, NULL));
    if (m->branch_scale != 1.f) scale_rows(m, r->hidden, tokens, h);
    if (sum) add_rows(m, b->branch, r->hidden, tokens * h); /* attn + mlp, handed on beside the residual as it was */
    return OK;
}

/* Every layer over all the rows at once, each kernel splitting its work among the OpenMP team. */
static int all_rows(const core_decoder *m, const core_layer *layers, int64_t num_layers, int residual_given,
                    const row_span *rows, int64_t table_width) {
    layer_buffers b;
    int status = alloc_buffers(m, rows->count, &b);
    for (int64_t l = 0; status == OK && l < num_layers; ++l)
        status = layer(m, layers + l, l == 0 && !residual_given, rows, table_width, &b);
    free(b.memory);
    return status;
}

/* The row-group path: the rows are cut into groups (GROUPS_PER_THREAD a thread, of at least group_rows
 * rows), and a unit of work is one layer of one group, run by one thread with every kernel on that thread
 * alone. A thread takes the group furthest
 * behind that no thread holds, runs its next layer and lets it go; the groups are independent (each row
 * is its own sequence's one new token: a step whose rows read each other's K/V comes with group_rows 0,
 * native_decode.py), so nothing waits for anything but a group's previous layer.
 * Where the kernels' own splits make both threads meet at the end of every kernel (~300 times a step of
 * 30 layers), so that a thread the OS takes away for a few milliseconds (the server's event loop, the
 * clients on the same two cores) holds the other up for as long, here the other thread goes on with the
 * other groups. Each output is computed as on the other path (the kernels' results for a row do not
 * depend on the other rows of a call), so the two paths agree bit for bit. */
static int row_groups(const core_decoder *m, const core_layer *layers, int64_t num_layers, int64_t tokens,
                      int residual_given, void *hidden, void *residual, const int64_t *positions,
                      const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lengths,
                      int64_t threads) {
    const int64_t most = GROUPS_PER_THREAD * threads, wanted = (tokens + most - 1) / most,
                  size = wanted > m->group_rows ? wanted : m->group_rows, groups = (tokens + size - 1) / size;
    int64_t *next = calloc((size_t)groups, sizeof(int64_t)); /* each group's next layer */
    int32_t *held = calloc((size_t)groups, sizeof(int32_t)); /* 1 while a thread runs one of its layers */
    int failed = OK;
    if (!next || !held) {
        free(next);
        free(held);
        return ERR_MEMORY;
    }
#pragma omp parallel
    {
        layer_buffers b;
        int64_t waits = 0;
        if (alloc_buffers(m, size, &b) != OK) __atomic_store_n(&failed, ERR_MEMORY, __ATOMIC_RELAXED);
        while (!__atomic_load_n(&failed, __ATOMIC_RELAXED)) {
            int64_t pick = -1, behind = num_layers, done = 0;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t l = __atomic_load_n(next + g, __ATOMIC_ACQUIRE);
                done += l == num_layers;
                if (l < behind && !__atomic_load_n(held + g, __ATOMIC_RELAXED)) pick = g, behind = l;
            }
            if (done == groups) break;
            int32_t unheld = 0;
            if (pick < 0 || !__atomic_compare_exchange_n(held + pick, &unheld, 1, 0, __ATOMIC_ACQUIRE,
                                                         __ATOMIC_RELAXED)) {
                /* every group left is held (the other thread is on its last ones): a while on the core, then
                   lend it (the other may be waiting for a core, behind whatever took its own) */
                if (++waits % 64 == 0) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
                else __builtin_ia32_pause();
#endif
                continue;
            }
            const int64_t l = __atomic_load_n(next + pick, __ATOMIC_ACQUIRE);
            if (l < num_layers) {
                const int64_t first = pick * size, count = tokens - first < size ? tokens - first : size;
                const row_span r = span_of(m, first, count, hidden, residual, positions, slots, tables, table_width,
                                           lengths);
                const int status = layer(m, layers + l, l == 0 && !residual_given, &r, table_width, &b);
                if (status != OK) __atomic_store_n(&failed, status, __ATOMIC_RELAXED);
                __atomic_store_n(next + pick, l + 1, __ATOMIC_RELEASE);
            }
            __atomic_store_n(held + pick, 0, __ATOMIC_RELEASE);
        }
        free(b.memory);
    }
    free(next);
    free(held);
    return failed;
}

int core_decoder_layers(const core_decoder *m, const core_layer *layers, int64_t num_layers, int64_t tokens,
                        void *hidden, void *residual, int residual_given, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lengths) {
    if (!m || (num_layers > 0 && !layers) || num_layers < 0 || tokens < 0 || (tokens > 0 && (!hidden ||
        !residual || !positions || !slots || !tables || !lengths)) || (m->dtype != DT_F32 && m->dtype != DT_BF16) ||
        m->hidden <= 0 || m->heads <= 0 || m->kv_heads <= 0 || m->head_dim <= 0 || m->inter <= 0 ||
        m->group_rows < 0 || (m->act != ACT_SILU && m->act != ACT_GELU_TANH &&
                                !((m->act == ACT_RELU2 || m->act == ACT_XIELU) && m->ungated)) ||
        !(m->clip_qkv >= 0.f) ||
        m->norm_kind < NORM_RMS || m->norm_kind > NORM_LAYER || m->parallel < PARALLEL_NONE ||
        m->parallel > PARALLEL_SUM)
        return ERR_ARGS;
    if (tokens == 0 || num_layers == 0) return OK;
    const int64_t threads = omp_get_max_threads();
    /* Not on the tiles: their loop dequantizes each weight block once a call for all of its rows, so units of
       a few rows would dequantize every weight once a unit (64 rows: 71 ms a step on the 2-core Xeon in
       groups of 8, 41 ms in one call) */
    if (!m->tiles && m->group_rows > 0 && tokens >= m->group_from && tokens > m->group_rows && threads > 1 && !omp_in_parallel())
        return row_groups(m, layers, num_layers, tokens, residual_given, hidden, residual, positions, slots, tables,
                          table_width, lengths, threads);
    const row_span rows = span_of(m, 0, tokens, hidden, residual, positions, slots, tables, table_width, lengths);
    return all_rows(m, layers, num_layers, residual_given, &rows, table_width);
}
