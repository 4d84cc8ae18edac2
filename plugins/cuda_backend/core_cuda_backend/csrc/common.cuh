// Shared helpers of the core CUDA kernels: dtype codes, conversions, reductions, the C ABI conventions.
//
// The C ABI: every exported function is `extern "C"`, takes raw device pointers, sizes, element strides,
// a dtype code and a cudaStream_t, launches on that stream only (no host synchronisation, so launches
// can be captured into CUDA graphs) and returns 0 on success, a negative CoreStatus for bad arguments,
// or a positive cudaError_t from the launch. Python calls these through ctypes (see library.py), so no
// CUDA build of torch is needed to build them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#define CORE_EXPORT extern "C" __attribute__((visibility("default")))

namespace core_cuda {

// Must match library.py's DTYPE_CODES.
enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Must match library.py's STATUS_MESSAGES.
enum CoreStatus : int {
  kOk = 0,
  kBadDType = -1,
  kBadHeadDim = -2,
  kBadGroupSize = -3,
  kBadShape = -4,
};

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Round a float to T and back: reproduces the rounding of a torch op that computes in T.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float<T>(from_float<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* >= 33 floats */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch /* >= 33 floats */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -FLT_MAX;
  return warp_max(v);
}

inline int launch_status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace core_cuda

// Runs BODY with `scalar_t` bound to the C++ type of a DTypeCode; returns kBadDType for other codes.
#define CORE_DISPATCH_DTYPE(code, ...)                                  \
  switch (code) {                                                       \
    case core_cuda::kFloat32: { using scalar_t = float; __VA_ARGS__; break; }        \
    case core_cuda::kFloat16: { using scalar_t = __half; __VA_ARGS__; break; }       \
    case core_cuda::kBFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return core_cuda::kBadDType;                               \
  }

// Runs BODY with constexpr `kHeadDim` bound to 64 or 128; returns kBadHeadDim otherwise.
#define CORE_DISPATCH_HEAD_DIM(head_dim, ...)                           \
  switch (head_dim) {                                                   \
    case 64: { constexpr int kHeadDim = 64; __VA_ARGS__; break; }       \
    case 128: { constexpr int kHeadDim = 128; __VA_ARGS__; break; }     \
    default: return core_cuda::kBadHeadDim;                             \
  }
