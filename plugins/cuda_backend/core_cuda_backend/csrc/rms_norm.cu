// RMSNorm with an optional fused residual add, rounding like the plain-torch reference:
//   h = x (+ residual, rounded to T);  out = weight * T(h * rsqrt(mean(h^2) + eps))  (product rounded).
// One block per row; the row is read twice (the second read hits L1/L2).
#include "common.cuh"

namespace core_cuda {

template <typename T, bool kResidual>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                const T* __restrict__ weight, T* __restrict__ out,
                                T* __restrict__ residual_out, int hidden, int64_t x_stride,
                                int64_t residual_stride, float eps) {
  __shared__ float scratch[33];
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * x_stride;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float h = to_float(x_row[i]);
    if constexpr (kResidual) {
      h = round_to<T>(h + to_float(residual[row * residual_stride + i]));
      residual_out[row * hidden + i] = from_float<T>(h);
    }
    sum_sq += h * h;
  }
  const float rstd = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float h;
    if constexpr (kResidual) {
      h = to_float(residual_out[row * hidden + i]);  // written by this same thread above
    } else {
      h = to_float(x_row[i]);
    }
    out[row * hidden + i] = from_float<T>(to_float(weight[i]) * round_to<T>(h * rstd));
  }
}

}  // namespace core_cuda

CORE_EXPORT int core_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                              void* residual_out, int num_rows, int hidden, int64_t x_stride,
                              int64_t residual_stride, float eps, int dtype, cudaStream_t stream) {
  using namespace core_cuda;
  if (num_rows == 0) return kOk;
  if (num_rows < 0 || hidden <= 0) return kBadShape;
  const int threads = min(1024, max(32, ((hidden / 4 + 31) / 32) * 32));
  CORE_DISPATCH_DTYPE(dtype, {
    const auto* xp = static_cast<const scalar_t*>(x);
    const auto* wp = static_cast<const scalar_t*>(weight);
    auto* op = static_cast<scalar_t*>(out);
    if (residual != nullptr) {
      rms_norm_kernel<scalar_t, true><<<num_rows, threads, 0, stream>>>(
          xp, static_cast<const scalar_t*>(residual), wp, op, static_cast<scalar_t*>(residual_out), hidden,
          x_stride, residual_stride, eps);
    } else {
      rms_norm_kernel<scalar_t, false><<<num_rows, threads, 0, stream>>>(xp, nullptr, wp, op, nullptr, hidden,
                                                                         x_stride, 0, eps);
    }
  });
  return launch_status();
}
