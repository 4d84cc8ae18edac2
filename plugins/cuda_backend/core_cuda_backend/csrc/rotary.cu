// Neox (rotate-half) rotary embedding of q [T, Hq, D] and k [T, Hkv, D] into new contiguous outputs.
//
// cos/sin caches are float32 [max_positions, D / 2] as the pytorch backend builds them (Llama 3 and linear
// scaling are folded into their frequencies). Rounds like the reference, which computes in T:
//   out_lo = T(x_lo * c) - T(x_hi * s),  out_hi = T(x_hi * c) + T(x_lo * s),  with c, s rounded to T.
#include "common.cuh"

namespace core_cuda {

template <typename T>
__device__ __forceinline__ void rotate_head(const T* __restrict__ src, T* __restrict__ dst,
                                            const float* __restrict__ cos_row,
                                            const float* __restrict__ sin_row, int half, int pair) {
  const float c = round_to<T>(cos_row[pair]), s = round_to<T>(sin_row[pair]);
  const float lo = to_float(src[pair]), hi = to_float(src[pair + half]);
  dst[pair] = from_float<T>(round_to<T>(lo * c) - round_to<T>(hi * s));
  dst[pair + half] = from_float<T>(round_to<T>(hi * c) + round_to<T>(lo * s));
}

template <typename T>
__global__ void rotary_kernel(const T* __restrict__ query, const T* __restrict__ key, T* __restrict__ q_out,
                              T* __restrict__ k_out, const int64_t* __restrict__ positions,
                              const float* __restrict__ cos_cache, const float* __restrict__ sin_cache,
                              int num_q_heads, int num_kv_heads, int head_dim, int64_t q_token_stride,
                              int64_t q_head_stride, int64_t k_token_stride, int64_t k_head_stride) {
  const int64_t token = blockIdx.x;
  const int half = head_dim / 2;
  const int64_t pos = positions[token];
  const float* cos_row = cos_cache + pos * half;
  const float* sin_row = sin_cache + pos * half;
  const int q_work = num_q_heads * half;
  for (int i = threadIdx.x; i < (num_q_heads + num_kv_heads) * half; i += blockDim.x) {
    if (i < q_work) {
      const int head = i / half, pair = i % half;
      rotate_head(query + token * q_token_stride + head * q_head_stride,
                  q_out + (token * num_q_heads + head) * head_dim, cos_row, sin_row, half, pair);
    } else {
      const int head = (i - q_work) / half, pair = (i - q_work) % half;
      rotate_head(key + token * k_token_stride + head * k_head_stride,
                  k_out + (token * num_kv_heads + head) * head_dim, cos_row, sin_row, half, pair);
    }
  }
}

}  // namespace core_cuda

CORE_EXPORT int core_apply_rotary(const void* query, const void* key, void* q_out, void* k_out,
                                  const int64_t* positions, const float* cos_cache, const float* sin_cache,
                                  int num_tokens, int num_q_heads, int num_kv_heads, int head_dim,
                                  int64_t q_token_stride, int64_t q_head_stride, int64_t k_token_stride,
                                  int64_t k_head_stride, int dtype, cudaStream_t stream) {
  using namespace core_cuda;
  if (num_tokens == 0) return kOk;
  if (num_tokens < 0 || num_q_heads <= 0 || num_kv_heads < 0 || head_dim <= 0 || head_dim % 2) return kBadShape;
  const int work = (num_q_heads + num_kv_heads) * head_dim / 2;
  const int threads = min(512, ((work + 31) / 32) * 32);
  CORE_DISPATCH_DTYPE(dtype, {
    rotary_kernel<scalar_t><<<num_tokens, threads, 0, stream>>>(
        static_cast<const scalar_t*>(query), static_cast<const scalar_t*>(key),
        static_cast<scalar_t*>(q_out), static_cast<scalar_t*>(k_out), positions, cos_cache, sin_cache,
        num_q_heads, num_kv_heads, head_dim, q_token_stride, q_head_stride, k_token_stride, k_head_stride);
  });
  return launch_status();
}
