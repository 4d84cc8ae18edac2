/* Dequantize output rows [n0, n1) of a 4-bit weight into a dense float32 or bfloat16 block, for the
 * steps of many rows that a dense GEMM serves faster than a packed kernel (the block is small enough to
 * stay in cache between this pass and the GEMM that reads it).
 *
 * codes [N][K / 2], groups in pairs: byte j of pair p holds code j of group 2p in its low nibble and
 * code j of group 2p+1 in its high one (so that each group's codes unpack in order, in vectors);
 * scales_zeros [K / group][N][2] (torch's int4 CPU kernel's own table, float32 or bfloat16):
 * w = (q - 8) * scale + zero, computed in float32. out [n1 - n0][K].
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { OK = 0, ERR_ARGS = 1 };

static inline float bf16_value(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

/* one row; inlined with group a constant where it is 32 (GGUF's blocks), so its loops unroll */
static inline __attribute__((always_inline)) void dequantize_row(const uint8_t *codes, int64_t row, int64_t n0,
                                                                  int64_t n, int64_t k, const void *scales_zeros,
                                                                  int sz_dtype, int64_t group, void *out,
                                                                  int out_dtype) {
    const uint8_t *c = codes + row * (k / 2);
    for (int64_t pair = 0; pair < k / (2 * group); ++pair) {
        const uint8_t *bytes = c + pair * group;
        for (int half = 0; half < 2; ++half) {
            const int64_t g = 2 * pair + half, at = (g * n + row) * 2;
            const float s = sz_dtype == DT_BF16 ? bf16_value(((const uint16_t *)scales_zeros)[at])
                                                : ((const float *)scales_zeros)[at];
            const float z = sz_dtype == DT_BF16 ? bf16_value(((const uint16_t *)scales_zeros)[at + 1])
                                                : ((const float *)scales_zeros)[at + 1];
            const float base = z - 8.f * s;
            const int shift = half * 4;
            const int64_t o = (row - n0) * k + g * group;
            if (out_dtype == DT_BF16) {
                uint16_t *dst = (uint16_t *)out + o;
#if defined(__AVX512F__)
                if (group % 16 == 0) {
                    const __m512 scale = _mm512_set1_ps(s), offset = _mm512_set1_ps(base);
                    const __m512i nibble = _mm512_set1_epi32(0x0f), bias = _mm512_set1_epi32(0x7fff);
                    for (int64_t j = 0; j < group; j += 16) {
                        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + j)));
                        q = _mm512_and_si512(_mm512_srli_epi32(q, shift), nibble);
                        __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, offset);
                        __m512i bits = _mm512_castps_si512(w); /* finite: round to nearest even, no NaN case */
                        bits = _mm512_add_epi32(bits, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                                                            _mm512_set1_epi32(1))));
                        _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
                    }
                    continue;
                }
#endif
#pragma omp simd
                for (int64_t j = 0; j < group; ++j) dst[j] = to_bf16((float)((bytes[j] >> shift) & 0x0f) * s + base);
            } else {
                float *dst = (float *)out + o;
#pragma omp simd
                for (int64_t j = 0; j < group; ++j) dst[j] = (float)((bytes[j] >> shift) & 0x0f) * s + base;
            }
        }
    }
}

int core_dequantize_int4(const uint8_t *codes, int64_t n0, int64_t n1, int64_t n, int64_t k,
                         const void *scales_zeros, int sz_dtype, int64_t group, void *out, int out_dtype) {
    if (!codes || !scales_zeros || !out || n0 < 0 || n1 > n || n0 > n1 || k <= 0 || k % 2 || group <= 0 ||
        k % (2 * group) || (sz_dtype != DT_F32 && sz_dtype != DT_BF16) ||
        (out_dtype != DT_F32 && out_dtype != DT_BF16))
        return ERR_ARGS;
#pragma omp parallel for schedule(static) if ((n1 - n0) * k > 65536)
    for (int64_t row = n0; row < n1; ++row) {
        if (group == 32)
            dequantize_row(codes, row, n0, n, k, scales_zeros, sz_dtype, 32, out, out_dtype);
        else
            dequantize_row(codes, row, n0, n, k, scales_zeros, sz_dtype, group, out, out_dtype);
    }
    return OK;
}
