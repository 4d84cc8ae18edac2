/* Why the packed kernel's exact AMX loop (exact_tile_outputs, in since 2026-12-06) gains little: what one group
 * of 32 inputs costs on this CPU's AMX tiles when
 * each group's integer dots must come out of the tiles to be folded with the group's own scales (as
 * csrc/packed_linear.c folds them), against the AVX-512 VNNI instructions the kernel uses.
 *
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mamx-tile -mamx-int8 \
 *       benchmarks/amx_group_fold.c -o /tmp/amx_group_fold && /tmp/amx_group_fold
 *
 * Needs a CPU with AMX-INT8 (Sapphire Rapids and later Xeons) and Linux 5.16+ (arch_prctl grants the
 * tiles). Prints, for one "group tile" (16 activation rows x 16 weight rows x 32 inputs, with the two
 * int8 activation steps: 16,384 multiply-adds, 8,192 useful):
 *   - the clock (a chain of 3-cycle imuls) and vpdpbusd zmm throughput (the VNNI loop needs 256 of them
 *     a group tile, so 256 / that rate is its floor);
 *   - tdpbsud throughput (two a group tile: one per activation step);
 *   - the tiles' part alone (zero, load activations and weights, two tdpbsud, two tile stores), the
 *     fold alone (the two int32 tiles' rows read back and folded into float sums: (127 hi + lo) * s * d
 *     + o * sum, as fold_group does), and both together (what an AMX kernel pays a group tile).
 * On the 2-core Xeon of 2026-12-02 (2.7-3.0 GHz), two runs: vpdpbusd 5.24-5.49 G/s (256 of them: 47-49
 * ns), tdpbsud 5.6-6.4 ns, tiles 32-33 ns and fold 27-28 ns, 67-71 ns together (they do not overlap,
 * also with the next group's tiles issued before this one's fold, or two blocks a group: 65-68 ns),
 * against ~97 ns a group tile for the VNNI kernel inside core_packed_linear (M = 32-64, 4-bit codes):
 * at best 1.4x here, and no faster once built into the kernel (0.98-1.3x its time at M = 16-256; served at
 * 32 streams, 329 / 329 against 429 / 394 out tok/s). Built again on 2026-12-06 inside the VNNI loop (its
 * row tiles of 16, the native decode stack's row groups no longer cutting steps into 4-8 rows): 1.2-1.4x
 * the vector loop's speed at 16-64 rows, +3-5% served at 32 / 64 streams (docs/DESIGN.md). */
#define _DEFAULT_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KP 576 /* SmolLM2-135M's hidden size */
#define GROUPS (KP / 32)
#define REPEATS 20
#define CALLS 2000

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config_t;

static int8_t q1[16 * KP] __attribute__((aligned(64))), q2[16 * KP] __attribute__((aligned(64)));
static uint8_t codes[4][GROUPS * 512] __attribute__((aligned(64))); /* [G][8][16][4], as the kernel's */
static float d[16 * GROUPS], sums[16 * GROUPS], scales[4][GROUPS * 16], offsets[4][GROUPS * 16];
static int32_t hi_rows[16][16] __attribute__((aligned(64))), lo_rows[16][16] __attribute__((aligned(64)));
static float out[16][16];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline __m512 fold(__m512 acc, __m512i hi, __m512i lo, __m512 s, __m512 o, float dg, float sum) {
    __m512i dot = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 7), hi), lo);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(dg)), acc);
    return _mm512_fmadd_ps(o, _mm512_set1_ps(sum), acc);
}

/* one block's 16 x 16 outputs over every group: the tiles' part, the fold, or both */
static __attribute__((noinline)) void block(int which, int tiles, int folding) {
    const uint8_t *w = codes[which];
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < GROUPS; ++g) {
        if (tiles) {
            _tile_zero(3);
            _tile_zero(4);
            _tile_loadd(0, q1 + g * 32, KP);
            _tile_loadd(1, q2 + g * 32, KP);
            _tile_loadd(2, w + g * 512, 64);
            _tile_dpbsud(3, 0, 2);
            _tile_dpbsud(4, 1, 2);
            _tile_stored(3, hi_rows, 64);
            _tile_stored(4, lo_rows, 64);
        }
        if (folding) {
            const __m512 s = _mm512_loadu_ps(scales[which] + g * 16), o = _mm512_loadu_ps(offsets[which] + g * 16);
            for (int i = 0; i < 16; ++i)
                acc[i] = fold(acc[i], _mm512_load_si512(hi_rows[i]), _mm512_load_si512(lo_rows[i]), s, o,
                              d[i * GROUPS + g], sums[i * GROUPS + g]);
        }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

static double per_group_ns(int tiles, int folding) {
    double best = 1e30;
    for (int r = 0; r < REPEATS; ++r) {
        const double t0 = now();
        for (int c = 0; c < CALLS; ++c) block(c & 3, tiles, folding);
        const double t = (now() - t0) / CALLS / GROUPS * 1e9;
        best = t < best ? t : best;
    }
    return best;
}

static double clock_ghz(void) {
    const long n = 300000000;
    long x = 1;
    const double t0 = now();
    for (long i = 0; i < n; ++i) __asm__ volatile("imul $3, %0, %0" : "+r"(x));
    return 3.0 * n / (now() - t0) / 1e9;
}

static double vpdpbusd_per_ns(void) {
    const long n = 100000000;
    const double t0 = now();
    __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0\n vpxord %%zmm1, %%zmm1, %%zmm1\n mov %0, %%rcx\n 1:\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm2\n vpdpbusd %%zmm1, %%zmm0, %%zmm3\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm4\n vpdpbusd %%zmm1, %%zmm0, %%zmm5\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm6\n vpdpbusd %%zmm1, %%zmm0, %%zmm7\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm8\n vpdpbusd %%zmm1, %%zmm0, %%zmm9\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm10\n vpdpbusd %%zmm1, %%zmm0, %%zmm11\n"
                     "vpdpbusd %%zmm1, %%zmm0, %%zmm12\n vpdpbusd %%zmm1, %%zmm0, %%zmm13\n"
                     "dec %%rcx\n jnz 1b\n"
                     :
                     : "r"(n)
                     : "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                       "xmm10", "xmm11", "xmm12", "xmm13");
    return 12.0 * n / ((now() - t0) * 1e9);
}

static double tdpbsud_ns(void) {
    const long n = 2000000;
    const double t0 = now();
    for (long i = 0; i < n; ++i) { /* four independent accumulators */
        _tile_dpbsud(3, 0, 2);
        _tile_dpbsud(4, 1, 2);
        _tile_dpbsud(5, 0, 2);
        _tile_dpbsud(6, 1, 2);
    }
    return (now() - t0) / n / 4 * 1e9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
        fprintf(stderr, "the kernel does not grant the AMX tiles to this process\n");
        return 1;
    }
    tile_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16; /* activation codes: 16 rows x 32 */
    c.colsb[0] = c.colsb[1] = 32;
    c.rows[2] = 8; /* weight codes: 8 rows of 16 weight rows x 4 inputs */
    c.colsb[2] = 64;
    for (int t = 3; t < 7; ++t) { /* int32 dots: 16 x 16 */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
    for (int i = 0; i < 16 * KP; ++i) {
        q1[i] = (int8_t)(i % 7 - 3);
        q2[i] = (int8_t)(i % 5 - 2);
    }
    for (int b = 0; b < 4; ++b)
        for (int i = 0; i < GROUPS * 512; ++i) codes[b][i] = (uint8_t)(i % 16);
    for (int i = 0; i < 16 * GROUPS; ++i) d[i] = 0.01f, sums[i] = 0.1f;
    for (int b = 0; b < 4; ++b)
        for (int i = 0; i < GROUPS * 16; ++i) scales[b][i] = 0.1f, offsets[b][i] = 0.2f;

    const double ghz = clock_ghz(), vnni = vpdpbusd_per_ns(), tdp = tdpbsud_ns();
    printf("clock %.2f GHz; vpdpbusd zmm %.2f G/s (256 a group tile: %.1f ns); tdpbsud %.2f ns\n", ghz, vnni,
           256 / vnni, tdp);
    const double tiles = per_group_ns(1, 0), folding = per_group_ns(0, 1), both = per_group_ns(1, 1);
    printf("a group tile with AMX: tiles %.1f ns, fold %.1f ns, both %.1f ns\n", tiles, folding, both);
    _tile_release();
    return 0;
}
