/* The greedy token of each row of logits: the index of the row's largest value, the first of equal ones,
 * a NaN counting as larger than any number (torch.argmax's rule, which the sampler's greedy rows
 * followed). torch's CPU argmax reads ~3 GB/s here (2 ms a decode step of 32 rows over SmolLM2's
 * 49,152-token vocabulary on a 2-core Xeon, 4% of the step); two vectorized passes over a row (its
 * largest number, then the first index holding it) read it from cache at memory speed. */
#include <math.h>
#include <stdint.h>

#include "common.h"

#define SCAN 64      /* values compared at a time in the second pass before looking one by one */
#define CHUNK 4096   /* bfloat16 values converted at a time */

/* the largest number among v[0, n) (NaNs left out; -inf when there is none) and whether any is a NaN */
static float largest(const float *v, int64_t n, int *has_nan) {
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
        best = v[i] > best ? v[i] : best;
        nan |= v[i] != v[i];
    }
    *has_nan |= nan;
    return best;
}

/* the first i in [0, n) with v[i] equal to `target` (a NaN target: the first NaN), or -1 */
static int64_t first_index(const float *v, int64_t n, float target) {
    const int nan = target != target;
    for (int64_t start = 0; start < n; start += SCAN) {
        const int64_t end = start + SCAN < n ? start + SCAN : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = start; i < end; ++i) hit |= nan ? v[i] != v[i] : v[i] == target;
        if (hit)
            for (int64_t i = start; i < end; ++i)
                if (nan ? v[i] != v[i] : v[i] == target) return i;
    }
    return -1;
}

static int64_t row_argmax(const void *x, int dtype, int64_t row, int64_t n) {
    if (dtype == DT_F32) {
        const float *v = (const float *)x + row * n;
        int nan = 0;
        const float best = largest(v, n, &nan);
        return first_index(v, n, nan ? NAN : best);
    }
    float buf[CHUNK];
    float best = -INFINITY;
    int nan = 0;
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t len = n - c < CHUNK ? n - c : CHUNK;
        load_row(x, dtype, row * n + c, len, buf);
        const float m = largest(buf, len, &nan);
        best = m > best ? m : best;
    }
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t len = n - c < CHUNK ? n - c : CHUNK;
        load_row(x, dtype, row * n + c, len, buf);
        const int64_t at = first_index(buf, len, nan ? NAN : best);
        if (at >= 0) return c + at;
    }
    return 0; /* not reached: the largest value is in the row */
}

/* out[r] = the argmax of row r of x [rows, n] (float32 or bfloat16, contiguous); n >= 1 */
int core_argmax_rows(const void *x, int dtype, int64_t rows, int64_t n, int64_t *out) {
    if ((rows > 0 && (!x || !out)) || rows < 0 || n <= 0 || (dtype != DT_F32 && dtype != DT_BF16)) return ERR_ARGS;
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n > PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x, dtype, r, n);
    return OK;
}
