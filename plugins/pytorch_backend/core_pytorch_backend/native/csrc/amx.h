/* What the AMX loops share (packed_linear.c's tile loop, chunk_attention.c's prefill attention): the
 * tile configuration every one of them uses, set on each thread before its first tile instruction. */
#ifndef CORE_CPU_AMX_H
#define CORE_CPU_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define AMX_ROWS 16 /* rows of every tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* every tile 16 rows of 64 bytes: a float32 tile 16 x 16, a bfloat16 tile 16 x 32 (or 16 pairs x 16 x 2) */
static inline void amx_configure(void) {
    tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&config);
}

#if defined(__AMX_INT8__)
/* packed_linear.c's exact int8 tile loop: tiles 0-3 16 x 16 int32 sums, 4-5 16 activation rows x 32 int8
 * codes (a group), 6-7 8 steps x 16 weight rows x 4 codes (the packed layout of a group as it is) */
static inline void amx_configure_int8(void) {
    tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = t == 4 || t == 5 ? 32 : 64;
        config.rows[t] = t >= 6 ? 8 : AMX_ROWS;
    }
    _tile_loadconfig(&config);
}
#endif

#endif

#endif
