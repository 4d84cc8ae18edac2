/* One decode step of the Mamba-2 mixer (state space duality: Mamba-2, Granite 4.0-H, Bamba, Nemotron-H,
 * Falcon-H1): each of P (sequence, head) pairs has a float32 state h [head_dim][state] and one token's x
 * [head_dim] and time step dt (after softplus); the head's group gives B and C [state]. With a = e^(dt A)
 * (models/mamba2_mixer.py ssd_step, transformers' Mamba2Mixer.torch_forward):
 *   h' = a h + x (dt B)^T,   y = h' C.
 * A decode step's cost is the state's memory traffic (Granite 4.0-H: 16 KiB a pair, 48 pairs a sequence and
 * layer). torch took three passes over it (the decay, the outer product added, the product with C); here
 * each row of a pair's state is read, updated and multiplied by C at once. Each output is one float32 sum over
 * the state in order; the pairs are split among the threads. */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "common.h"

#define MAX_STATE 1024

typedef struct {
    const float *x, *dt, *a, *b, *c;
    float *state, *y;
    int64_t pairs, heads, groups, head_dim, size;
} ssd_team;

static void ssd_pair(const ssd_team *t, int64_t p) {
    const int64_t head = p % t->heads, sequence = p / t->heads;
    const int64_t group = head / (t->heads / t->groups), size = t->size, head_dim = t->head_dim;
    const float dt = t->dt[p], decay = expf(dt * t->a[head]);
    const float *b = t->b + (sequence * t->groups + group) * size, *c = t->c + (sequence * t->groups + group) * size;
    const float *x = t->x + p * head_dim;
    float *h = t->state + p * head_dim * size, *y = t->y + p * head_dim;
    float inflow[MAX_STATE];
    for (int64_t n = 0; n < size; ++n) inflow[n] = dt * b[n];
    for (int64_t i = 0; i < head_dim; ++i) {
        float *row = h + i * size, sum = 0.f;
        const float xi = x[i];
        for (int64_t n = 0; n < size; ++n) {
            row[n] = decay * row[n] + xi * inflow[n];
            sum += row[n] * c[n];
        }
        y[i] = sum;
    }
}

static void ssd_work(void *context, int64_t thread, int64_t threads) {
    const ssd_team *t = context;
    int64_t p, end;
    for (team_share(t->pairs, thread, threads, &p, &end); p < end; ++p) ssd_pair(t, p);
}

/* x [S, H, head_dim], dt [S, H], a [H], b and c [S, G, state], state [S, H, head_dim, state] (updated in
 * place), y [S, H, head_dim]: all float32, contiguous; H a multiple of G. */
int core_ssd_step(const float *x, const float *dt, const float *a, const float *b, const float *c, float *state,
                  int64_t sequences, int64_t heads, int64_t groups, int64_t head_dim, int64_t size, float *y) {
    if (sequences < 0 || heads <= 0 || groups <= 0 || heads % groups || head_dim <= 0 || size <= 0 || size > MAX_STATE)
        return ERR_ARGS;
    if (sequences > 0 && (!x || !dt || !a || !b || !c || !state || !y)) return ERR_ARGS;
    ssd_team team = {x, dt, a, b, c, state, y, sequences * heads, heads, groups, head_dim, size};
    run_team(sequences * heads * head_dim * size > PARALLEL_MIN_WORK, ssd_work, &team);
    return OK;
}
