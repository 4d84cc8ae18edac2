// KV-cache store: each new token's K and V rows go to their slot of the paged cache.
//
// key/value: [T, Hkv, D] with any token and head stride (the D elements of a head contiguous), e.g. views
// into a fused QKV projection. Caches: [num_blocks, block_size, Hkv, D], contiguous. A negative slot
// (padding) is skipped.
#include "common.cuh"

namespace core_cuda {

template <typename T>
__global__ void store_kv_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                      T* __restrict__ k_cache, T* __restrict__ v_cache,
                                      const int64_t* __restrict__ slot_mapping, int64_t key_token_stride,
                                      int64_t key_head_stride, int64_t value_token_stride,
                                      int64_t value_head_stride, int num_kv_heads, int head_dim) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int row = num_kv_heads * head_dim;
  T* k_dst = k_cache + slot * row;
  T* v_dst = v_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int head = i / head_dim, d = i % head_dim;
    k_dst[i] = key[token * key_token_stride + head * key_head_stride + d];
    v_dst[i] = value[token * value_token_stride + head * value_head_stride + d];
  }
}

}  // namespace core_cuda

CORE_EXPORT int core_store_kv_cache(const void* key, const void* value, void* k_cache, void* v_cache,
                                    const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                                    int head_dim, int64_t key_token_stride, int64_t key_head_stride,
                                    int64_t value_token_stride, int64_t value_head_stride, int dtype,
                                    cudaStream_t stream) {
  using namespace core_cuda;
  if (num_tokens == 0) return kOk;
  if (num_tokens < 0 || num_kv_heads <= 0 || head_dim <= 0) return kBadShape;
  const int threads = min(1024, ((num_kv_heads * head_dim + 31) / 32) * 32);
  CORE_DISPATCH_DTYPE(dtype, {
    store_kv_cache_kernel<scalar_t><<<num_tokens, threads, 0, stream>>>(
        static_cast<const scalar_t*>(key), static_cast<const scalar_t*>(value),
        static_cast<scalar_t*>(k_cache), static_cast<scalar_t*>(v_cache), slot_mapping, key_token_stride,
        key_head_stride, value_token_stride, value_head_stride, num_kv_heads, head_dim);
  });
  return launch_status();
}
