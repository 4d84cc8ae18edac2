/* What every kernel file shares: dtype and status codes, bfloat16 and half conversions, rows loaded
 * and stored as float32, a vectorizable e^x, and the paged KV cache's slots. */
#ifndef CORE_CPU_COMMON_H
#define CORE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_KV8 = 3 }; /* library.py passes these; DT_KV8: a KV cache only */
/* a packed weight's scales (and offsets) as int8 multiples of a float32 unit per 256 inputs, of groups of 32 or 16
 * inputs (packed_linear.c factored_super) */
enum { DT_S8_32 = 4, DT_S8_16 = 5 };
enum { OK = 0, ERR_ARGS = 1, ERR_MEMORY = 2 }; /* library.py STATUS */

/* Elements of work from which an elementwise kernel (a norm, rotary, silu * up, the activations'
 * quantization) splits its rows among the threads: below it, starting the team costs more than it
 * saves. In a decode step the threads are awake (one kernel follows another); at the former 65536 a
 * 32-row step of SmolLM2 (576 x 32 = 18432) ran its activations' quantization, norms, rotary and
 * silu * up on one thread while the other spun (perf: a quarter of that thread's samples in libgomp),
 * and 8192 made the native decode stack ~4% faster at 32 and 64 rows on a 2-core Zen 4 EPYC (Genoa). */
#define PARALLEL_MIN_WORK 8192

/* Whether a kernel starts a team for its work: worth it (`wanted`) and not already on one thread of a
 * team (decoder_stack.c's row-group path gives each thread a unit of its own: a nested team there would
 * put more threads than cores on the CPU, where libgomp allows nesting). */
static inline int core_team(int wanted) { return wanted && !omp_in_parallel(); }

/* body(ctx, thread, threads) on a team of its own where core_team(wanted), else once on the calling thread
 * as thread 0 of 1, without a call into libgomp (a region of one thread inside a row-group unit cost
 * ~0.8 us, and a 32-row decode step of the default model opens ~2,000 of them). A body splits its work by
 * (thread, threads) and meets the others only at team_barrier. */
typedef void (*team_body)(void *ctx, int64_t thread, int64_t threads);

static inline void run_team(int wanted, team_body body, void *ctx) {
    if (core_team(wanted)) {
#pragma omp parallel
        body(ctx, omp_get_thread_num(), omp_get_num_threads());
    } else {
        body(ctx, 0, 1);
    }
}

static inline void team_barrier(int64_t threads) {
    if (threads > 1) {
#pragma omp barrier
    }
}

/* thread's contiguous share [*begin, *end) of `total` items (as schedule(static)) */
static inline void team_share(int64_t total, int64_t thread, int64_t threads, int64_t *begin, int64_t *end) {
    *begin = total * thread / threads;
    *end = total * (thread + 1) / threads;
}

static inline void team_fail(int *status, int value) { __atomic_store_n(status, value, __ATOMIC_RELAXED); }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* round to nearest even; a NaN stays a NaN (quiet); branch-free so that loops of it vectorize */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

/* IEEE half to float, exactly (normals, subnormals, infinities, NaNs) */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: m * 2^-24 */
        float f = (float)mantissa * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n values of a float32 or bfloat16 row from element `offset` on, as float32 */
static inline void load_row(const void *src, int dtype, int64_t offset, int64_t n, float *dst) {
    if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &bits, 4);
            dst[i] = f;
        }
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    }
}

/* n float32 values stored as the dtype's from element `offset` on */
static inline void store_row(void *dst, int dtype, int64_t offset, int64_t n, const float *src) {
    if (dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)dst + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    }
}

/* An int8 KV cache (DT_KV8, kernels/kv_int8.py) keeps each position's row of one KV head as its D values'
 * codes c (uint8, 0..255), then its float32 scale s and minimum m: the values are m + c s (two roundings:
 * the build contracts no multiply-add), the codes round((x - m) / s) with s = (max - min) / 255 (0, and
 * every code 0, where the row's values are all equal). */
#define KV8_EXTRA 8

/* bytes of one KV head's row of one position in a cache of `dtype` */
static inline int64_t cache_row_bytes(int dtype, int64_t d) {
    return dtype == DT_KV8 ? d + KV8_EXTRA : d * (dtype == DT_F32 ? 4 : 2);
}

/* an int8 row's scale and minimum (after its D codes) */
static inline void kv8_tail(const uint8_t *row, int64_t d, float *scale, float *low) {
    memcpy(scale, row + d, sizeof(float));
    memcpy(low, row + d + sizeof(float), sizeof(float));
}

/* row `row` (slot * Hkv + KV head) of a cache of float32, bfloat16 or int8 rows, as float32 */
static inline void load_cache_row(const void *cache, int dtype, int64_t row, int64_t d, float *dst) {
    if (dtype != DT_KV8) {
        load_row(cache, dtype, row * d, d, dst);
        return;
    }
    const uint8_t *codes = (const uint8_t *)cache + row * (d + KV8_EXTRA);
    float scale, low;
    kv8_tail(codes, d, &scale, &low);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = (float)codes[i] * scale + low;
}

/* row `row` of a cache of float32, bfloat16 or int8 rows from float32 values */
static inline void store_cache_row(void *cache, int dtype, int64_t row, int64_t d, const float *src) {
    if (dtype != DT_KV8) {
        store_row(cache, dtype, row * d, d, src);
        return;
    }
    uint8_t *codes = (uint8_t *)cache + row * (d + KV8_EXTRA);
    float low = src[0], high = src[0];
    for (int64_t i = 1; i < d; ++i) {
        low = src[i] < low ? src[i] : low;
        high = src[i] > high ? src[i] : high;
    }
    const float scale = (high - low) / 255.f;
    for (int64_t i = 0; i < d; ++i) {
        const float code = scale > 0.f ? __builtin_nearbyintf((src[i] - low) / scale) : 0.f;
        codes[i] = (uint8_t)(code < 0.f ? 0.f : code > 255.f ? 255.f : code);
    }
    memcpy(codes + d, &scale, sizeof(float));
    memcpy(codes + d + sizeof(float), &low, sizeof(float));
}

/* e^x as 2^n * p(f), n = round(x log2 e), p a degree-6 polynomial of f = (x log2 e - n) ln 2 in
 * [-0.35, 0.35]: relative error ~2e-7 over [-87, 88] (0 below, as expf rounds to), and written so that
 * a loop of it vectorizes (no calls, no branches) on every variant. */
static inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float t = x * 1.44269504089f, n = __builtin_rintf(t), f = (t - n) * 0.69314718056f;
    float p = 1.f / 720;
    p = p * f + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n << 23; /* times 2^n: n in [-126, 127] and p in [0.7, 1.5] keep it a normal float */
    memcpy(&p, &bits, 4);
    return p;
}

/* gate[i] <- silu(gate[i]) * up[i] for n values, rounding after the silu and the product where the dtype
 * is bfloat16 (as torch: cpu_ops.c's silu * up, and the tile loop's fused gate / up epilogue, which must
 * give the same bits) */
static inline void silu_times(float *gate, const float *up, int64_t n, int dtype) {
    if (dtype == DT_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float g = bf16_to_f32(f32_to_bf16(gate[i] / (1.f + fast_exp(-gate[i]))));
            gate[i] = bf16_to_f32(f32_to_bf16(g * up[i]));
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.f + fast_exp(-gate[i])) * up[i];
    }
}

/* gate[i] <- gelu_tanh(gate[i]) * up[i], rounded as silu_times rounds (Gemma's MLP). gelu_tanh(x) = x/2 (1 + tanh(z))
 * with z = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + e^(-2z)) (the same function: (1 + tanh z) / 2 is the
 * logistic of 2z), so that it vectorizes with fast_exp; within a few float32 ulps of torch's tanh form. */
static inline void gelu_tanh_times(float *gate, const float *up, int64_t n, int dtype) {
    const float two_k = 2.f * 0.7978845608028654f;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float x = gate[i], g = x / (1.f + fast_exp(-two_k * (x + 0.044715f * x * x * x)));
        gate[i] = dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(g)) * up[i])) : g * up[i];
    }
}

/* the activations of core_act_and_mul and the decoder stack; ACT_RELU2 (relu(x)^2: Nemotron's, Arcee's, Jais 2's)
 * and ACT_XIELU (Apertus's, of four parameters: act_params) are core_act's alone (ungated MLPs) */
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define ACT_RELU2 2
#define ACT_XIELU 3

/* The cache slot of context position pos (32-bit division: positions and blocks fit, and 64-bit
 * division costs tens of cycles) */
static inline int64_t slot_of(const int32_t *table, int64_t pos, int64_t block_size) {
    const uint32_t p = (uint32_t)pos, b = (uint32_t)block_size;
    return (int64_t)table[p / b] * block_size + p % b;
}

typedef struct { /* one weight in packed_linear.c's layout (decoder_stack.c, moe_mix.c) */
    const uint8_t *codes;
    const void *scale, *offset;
    const float *bias; /* [N] float32, or NULL */
    int64_t n, kp;
    int32_t bits, group, scale_dtype; /* group: the inputs a scale covers (packed_linear.c) */
} core_packed;

/* A sparse mixture-of-experts block (models/sparse_moe.py's SparseMoeBlock) as moe_mix.c runs it whole: the router,
 * each token's top_k experts (SwiGLU MLPs of packed weights) and a shared expert (native/expert_mix.py, decoder_stack.c) */
typedef struct {
    const void *router;               /* [experts, hidden] of the activations' dtype */
    const float *router_bias;         /* [experts] float32, or NULL */
    const core_packed *gate_up, *down; /* [experts] each: expert e's [2 inter, hidden] and [hidden, inter] */
    const core_packed *shared;        /* [2]: the shared expert's gate_up and down, or NULL: none */
    const void *shared_gate;          /* [hidden] of the activations' dtype: the shared expert's output times
                                         sigmoid(x . shared_gate) (Qwen2-MoE); NULL: added as it is */
    int64_t experts, top_k, inter;
    int32_t normalize;                /* 1: the top_k probabilities renormalized to sum to 1 */
    int32_t softmax_of_top_k;         /* 1: the weights are the softmax of the top_k logits alone (Granite MoE) */
} core_moe;

/* The exported kernels, for a file that composes them (decoder_stack.c, chunk_attention.c); library.py
 * documents them. */
int core_packed_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                       int group, int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                       const float *bias, void *y, int y_dtype);
int core_packed_linear_tiles(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                             int group, int64_t n, int64_t kp, const void *scale, const void *offset, int scale_dtype,
                             const float *bias, void *y, int y_dtype);
int core_packed_linear_tiles_silu(const void *x, int x_dtype, int64_t m, int64_t k, const uint8_t *codes, int bits,
                                  int group, int64_t n, int64_t kp, const void *scale, const void *offset,
                                  int scale_dtype, const float *bias, void *y, int y_dtype);
int core_packed_uses_amx(void);
int core_moe_block(const core_moe *moe, const void *x, int dtype, int64_t tokens, int64_t hidden, const uint8_t *tiled,
                   int all_tiled, void *out);
int core_half_linear(const void *x, int x_dtype, int64_t m, int64_t k, const uint16_t *w, int w_dtype, int64_t n,
                     int64_t kp, const float *bias, void *y, int y_dtype, int reference);
#define HALF_TILE_BLOCKS 4 /* weight blocks of half_linear.c's tile, the most core_half_bf16_blocks takes */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
void core_half_bf16_blocks(const uint16_t *first, int blocks, const uint16_t *acts, int64_t kp, int64_t m0, int64_t m1,
                           int64_t col0, int64_t n, const float *bias, void *y, int y_dtype, int gated);
#endif
int core_decode_attention(const void *q, int q_dtype, int64_t rows, int64_t hq, int64_t d, const void *k_cache,
                          const void *v_cache, int cache_dtype, int64_t block_size, int64_t hkv,
                          const int32_t *tables, int64_t table_width, const int32_t *lengths, int64_t window,
                          float scale, float softcap, void *out);
int core_rms_norm(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                  const void *weight, int w_dtype, float eps, void *out, void *residual_out);
int core_silu_and_mul(const void *x, int dtype, int64_t tokens, int64_t inner, void *out);
int core_act_and_mul(const void *x, int dtype, int64_t tokens, int64_t inner, int act, void *out);
int core_act(const void *x, int dtype, int64_t tokens, int64_t inner, int act, const float *params, void *out);
int core_rms_norm_float(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                        const float *weight, float eps, void *out, void *residual_out);
int core_layer_norm(const void *x, int x_dtype, int64_t tokens, int64_t hidden, const void *residual,
                    const void *weight, const void *bias, int w_dtype, float eps, void *out, void *residual_out);
int core_rotary_part(const void *q, const void *k, int dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                     int64_t rotary_dim, int64_t q_row_stride, int64_t k_row_stride, const int64_t *positions,
                     const void *cos_table, const void *sin_table, int table_dtype, int64_t max_position, void *q_out,
                     void *k_out);
int core_rotary(const void *q, const void *k, int dtype, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                int64_t q_row_stride, int64_t k_row_stride, const int64_t *positions, const void *cos_table,
                const void *sin_table, int table_dtype, int64_t max_position, void *q_out, void *k_out);
int core_store_kv(const void *k, const void *v, int dtype, int64_t tokens, int64_t hkv, int64_t d,
                  int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots, void *k_cache, void *v_cache,
                  int cache_dtype, int64_t num_slots);

/* y [rows, w->n] = x [rows, k] @ W^T (+ bias) by the prompt loop where `tiled`, else the VNNI loop (decoder_stack.c,
 * moe_mix.c) */
static inline int packed_product(const core_packed *w, const void *x, int dtype, int64_t rows, int64_t k, int tiled,
                                 void *y) {
    return (tiled ? core_packed_linear_tiles : core_packed_linear)(x, dtype, rows, k, w->codes, w->bits, w->group, w->n,
                                                                   w->kp, w->scale, w->offset, w->scale_dtype, w->bias,
                                                                   y, dtype);
}

/* out [rows, w->n / 2] = act(gate) * up of a [gate | up] weight's product of x [rows, k]: on the prompt loop with
 * silu * up in its epilogue where that loop takes the weight (the same bits, no [rows, n] product), else the product
 * into gate_up and then core_act_and_mul */
static inline int packed_gated(const core_packed *w, const void *x, int dtype, int64_t rows, int64_t k, int tiled,
                               int act, void *gate_up, void *out) {
    if (tiled && act == ACT_SILU && w->group == 32 && w->bits != 16 && w->n % 32 == 0)
        return core_packed_linear_tiles_silu(x, dtype, rows, k, w->codes, w->bits, w->group, w->n, w->kp, w->scale,
                                             w->offset, w->scale_dtype, w->bias, out, dtype);
    const int status = packed_product(w, x, dtype, rows, k, tiled, gate_up);
    return status != OK ? status : core_act_and_mul(gate_up, dtype, rows, w->n / 2, act, out);
}

#endif
