// SiLU-and-multiply: out = T(silu(gate)) * up for x = [gate | up] along the last dimension, rounding like
// torch's `F.silu(gate) * up` in T. Grid: (rows, chunks of the half width).
#include "common.cuh"

namespace core_cuda {

template <typename T>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int half,
                                    int64_t x_stride) {
  const int64_t row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const T* up = gate + half;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < half; i += gridDim.y * blockDim.x) {
    const float g = to_float(gate[i]);
    const float silu = round_to<T>(g / (1.f + __expf(-g)));
    out[row * half + i] = from_float<T>(silu * to_float(up[i]));
  }
}

}  // namespace core_cuda

CORE_EXPORT int core_silu_and_mul(const void* x, void* out, int num_rows, int half, int64_t x_stride,
                                  int dtype, cudaStream_t stream) {
  using namespace core_cuda;
  if (num_rows == 0) return kOk;
  if (num_rows < 0 || half <= 0) return kBadShape;
  const int threads = 256;
  const dim3 grid(num_rows, min(64, (half + threads - 1) / threads));
  CORE_DISPATCH_DTYPE(dtype, {
    silu_and_mul_kernel<scalar_t><<<grid, threads, 0, stream>>>(static_cast<const scalar_t*>(x),
                                                                static_cast<scalar_t*>(out), half, x_stride);
  });
  return launch_status();
}
