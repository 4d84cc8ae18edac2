// Helpers shared by the paged attention kernels.
#pragma once

#include "common.cuh"

namespace core_cuda {

// Cache row (slot) of context token `t` of a sequence, through its block table.
__device__ __forceinline__ int64_t context_slot(const int32_t* __restrict__ table, int t, int block_size) {
  return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

// Eight consecutive elements of T as floats; `p` must be 16-byte aligned (32 for float).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&out)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_float(e[i]);
  }
}

}  // namespace core_cuda
