/* What every kernel file shares: dtype and status codes, and bfloat16 conversions. */
#ifndef CORE_CPU_COMMON_H
#define CORE_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 }; /* library.py passes these */
enum { OK = 0, ERR_ARGS = 1, ERR_MEMORY = 2 }; /* library.py STATUS */

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

#endif
