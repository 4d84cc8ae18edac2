/* A decode step through every layer of a Llama-like decoder in one call: the kernels a layer's modules
 * call one by one from Python (RMSNorm with the residual add, the packed q/k/v projection, per-head
 * q/k RMSNorm, rotary, the KV-cache store, paged decode attention, the o projection, the post-attention
 * RMSNorm, the packed gate/up projection, silu * up and the down projection), called here in the same
 * order on the same buffers. The results are therefore bit for bit those of the module path
 * (models/llama.py over kernels/native.py); what goes is ~100 us a layer of Python, dispatch and
 * allocation (a third of a one-row decode step of SmolLM2-135M on a 2-core EPYC).
 *
 * The model and its layers are described once (core_decoder, core_layer: pointers into the weights and
 * KV caches, which decoder_stack.py keeps alive and rebuilds when they move); a step passes its rows.
 * Every row is a decode row (one new token attending to its paged context). hidden [T, H] holds the
 * embeddings on entry and the last layer's MLP output on return; residual [T, H] the running sum
 * (given: residual_given; else layer 0 starts it from the embeddings, as LlamaDecoderLayer does).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef struct { /* one weight in packed_linear.c's layout */
    const uint8_t *codes;
    const void *scale, *offset;
    const float *bias; /* [N] float32, or NULL */
    int64_t n, kp;
    int32_t bits, scale_dtype;
} core_packed;

typedef struct {
    const void *input_norm, *post_norm; /* [H] of the activations' dtype */
    const void *q_norm, *k_norm;        /* [D] (Qwen3), or NULL */
    core_packed qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, Hkv, D] of the cache dtype */
    int64_t window;          /* sliding window, 0: none */
    float scale;             /* softmax scale */
} core_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int32_t dtype, cache_dtype, table_dtype; /* dtype: the activations' and the norm weights' */
    float eps;
    int64_t block_size, num_slots, max_position;
    const void *cos, *sin; /* [max_position, D / 2] of table_dtype */
    int32_t tiles;         /* 1: the packed weights multiply on the AMX tiles (core_packed_linear_tiles) */
} core_decoder;

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

static int linear(const core_decoder *m, const core_packed *w, const void *x, int64_t rows, int64_t k, void *y) {
    return (m->tiles ? core_packed_linear_tiles : core_packed_linear)(x, m->dtype, rows, k, w->codes, w->bits, w->n,
                                                                      w->kp, w->scale, w->offset, w->scale_dtype,
                                                                      w->bias, y, m->dtype);
}

/* rows [T, width] `stride` elements apart from src into contiguous dst */
static void copy_rows(const char *src, int64_t stride, int64_t rows, int64_t width, int64_t size, char *dst) {
    for (int64_t t = 0; t < rows; ++t) memcpy(dst + t * width * size, src + t * stride * size, (size_t)(width * size));
}

#define CHECK(call)              \
    do {                         \
        status = (call);         \
        if (status != OK) goto done; \
    } while (0)

int core_decoder_layers(const core_decoder *m, const core_layer *layers, int64_t num_layers, int64_t tokens,
                        void *hidden, void *residual, int residual_given, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lengths) {
    if (!m || (num_layers > 0 && !layers) || num_layers < 0 || tokens < 0 || (tokens > 0 && (!hidden ||
        !residual || !positions || !slots || !tables || !lengths)) || (m->dtype != DT_F32 && m->dtype != DT_BF16) ||
        m->hidden <= 0 || m->heads <= 0 || m->kv_heads <= 0 || m->head_dim <= 0 || m->inter <= 0)
        return ERR_ARGS;
    if (tokens == 0 || num_layers == 0) return OK;
    const int64_t size = elem_size(m->dtype), h = m->hidden, d = m->head_dim, hq = m->heads, hkv = m->kv_heads;
    const int64_t q_width = hq * d, kv_width = hkv * d, qkv_width = q_width + 2 * kv_width;
    /* one allocation for the step's buffers, reused by every layer */
    const int64_t normed_n = tokens * h, qkv_n = tokens * qkv_width, rot_n = tokens * (q_width + kv_width),
                  heads_n = tokens * (q_width + kv_width), attn_n = tokens * q_width,
                  gate_up_n = tokens * 2 * m->inter, act_n = tokens * m->inter;
    char *arena = malloc((size_t)((normed_n + qkv_n + rot_n + heads_n + attn_n + gate_up_n + act_n) * size));
    if (!arena) return ERR_MEMORY;
    char *normed = arena, *qkv = normed + normed_n * size, *rotated = qkv + qkv_n * size,
         *heads = rotated + rot_n * size, *attn = heads + heads_n * size, *gate_up = attn + attn_n * size,
         *act = gate_up + gate_up_n * size;
    char *q_rot = rotated, *k_rot = rotated + tokens * q_width * size;
    int status = OK;
    for (int64_t l = 0; l < num_layers; ++l) {
        const core_layer *L = layers + l;
        if (l == 0 && !residual_given) {
            memcpy(residual, hidden, (size_t)(tokens * h * size));
            CHECK(core_rms_norm(hidden, m->dtype, tokens, h, NULL, L->input_norm, m->dtype, m->eps, normed, NULL));
        } else {
            CHECK(core_rms_norm(hidden, m->dtype, tokens, h, residual, L->input_norm, m->dtype, m->eps, normed,
                                residual));
        }
        CHECK(linear(m, &L->qkv, normed, tokens, h, qkv));
        const char *q = qkv, *k = qkv + q_width * size, *v = qkv + (q_width + kv_width) * size;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (L->q_norm) { /* per-head RMSNorm of contiguous copies of q and k */
            char *qn = heads, *kn = heads + tokens * q_width * size;
            copy_rows(q, qkv_width, tokens, q_width, size, qn);
            copy_rows(k, qkv_width, tokens, kv_width, size, kn);
            CHECK(core_rms_norm(qn, m->dtype, tokens * hq, d, NULL, L->q_norm, m->dtype, m->eps, qn, NULL));
            CHECK(core_rms_norm(kn, m->dtype, tokens * hkv, d, NULL, L->k_norm, m->dtype, m->eps, kn, NULL));
            q = qn, k = kn, q_stride = q_width, k_stride = kv_width;
        }
        CHECK(core_rotary(q, k, m->dtype, tokens, hq, hkv, d, q_stride, k_stride, positions, m->cos, m->sin,
                          m->table_dtype, m->max_position, q_rot, k_rot));
        CHECK(core_store_kv(k_rot, v, m->dtype, tokens, hkv, d, kv_width, qkv_width, slots, L->k_cache, L->v_cache,
                            m->cache_dtype, m->num_slots));
        CHECK(core_decode_attention(q_rot, m->dtype, tokens, hq, d, L->k_cache, L->v_cache, m->cache_dtype,
                                    m->block_size, hkv, tables, table_width, lengths, L->window, L->scale, attn));
        CHECK(linear(m, &L->o, attn, tokens, q_width, hidden));
        CHECK(core_rms_norm(hidden, m->dtype, tokens, h, residual, L->post_norm, m->dtype, m->eps, normed,
                            residual));
        CHECK(linear(m, &L->gate_up, normed, tokens, h, gate_up));
        CHECK(core_silu_and_mul(gate_up, m->dtype, tokens, m->inter, act));
        CHECK(linear(m, &L->down, act, tokens, m->inter, hidden));
    }
done:
    free(arena);
    return status;
}
