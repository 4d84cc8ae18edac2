/* One decode step of the gated delta rule (Qwen3.5 and Qwen3-Next's gated DeltaNet, OLMo Hybrid's): each of
 * P (sequence, head) pairs has a float32 memory S [Dk][Dv] and one token's q, k [Dk], v [Dv], log decay g
 * and beta. With a = e^g (models/gated_deltanet.py recurrent_step, transformers'
 * torch_recurrent_gated_delta_rule):
 *   delta = beta (v - a k^T S),   S' = a S + k delta^T,   out = q^T S' = a q^T S + (q . k) delta.
 * A decode step's cost is S's memory traffic (Qwen3.5: 64 KiB a pair, 16 pairs a sequence and layer). torch
 * took four passes over it (k^T S and q^T S in one product, the decay, the outer product added); here a pair
 * is read once for both products and written once, the second pass finding it in L2. Each output is one float32
 * sum over Dk in input order; the pairs are split among the threads. */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "common.h"

#define MAX_VALUE_DIM 1024

typedef struct {
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    int64_t pairs, dk, dv;
} delta_team;

static void delta_pair(const delta_team *c, int64_t p) {
    const int64_t dk = c->dk, dv = c->dv;
    const float *q = c->q + p * dk, *k = c->k + p * dk, *v = c->v + p * dv;
    float *s = c->state + p * dk * dv, *out = c->out + p * dv;
    float k_read[MAX_VALUE_DIM], q_read[MAX_VALUE_DIM], delta[MAX_VALUE_DIM];
    for (int64_t j = 0; j < dv; ++j) k_read[j] = q_read[j] = 0.f;
    float qk = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i], qi = q[i];
        const float *row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
            k_read[j] += ki * row[j];
            q_read[j] += qi * row[j];
        }
        qk += qi * ki;
    }
    const float a = expf(c->g[p]), beta = c->beta[p];
    for (int64_t j = 0; j < dv; ++j) {
        delta[j] = beta * (v[j] - a * k_read[j]);
        out[j] = a * q_read[j] + qk * delta[j];
    }
    for (int64_t i = 0; i < dk; ++i) {
        const float ki = k[i];
        float *row = s + i * dv;
        for (int64_t j = 0; j < dv; ++j) row[j] = a * row[j] + ki * delta[j];
    }
}

static void delta_work(void *context, int64_t thread, int64_t threads) {
    const delta_team *c = context;
    int64_t p, end;
    for (team_share(c->pairs, thread, threads, &p, &end); p < end; ++p) delta_pair(c, p);
}

/* q, k [P, Dk], v [P, Dv], g, beta [P], state [P, Dk, Dv] (updated in place), out [P, Dv]: all float32,
 * contiguous. */
int core_delta_rule_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                         float *state, int64_t pairs, int64_t dk, int64_t dv, float *out) {
    if (pairs < 0 || dk <= 0 || dv <= 0 || dv > MAX_VALUE_DIM) return ERR_ARGS;
    if (pairs > 0 && (!q || !k || !v || !g || !beta || !state || !out)) return ERR_ARGS;
    delta_team team = {q, k, v, g, beta, state, out, pairs, dk, dv};
    run_team(pairs * dk * dv > PARALLEL_MIN_WORK, delta_work, &team);
    return OK;
}
