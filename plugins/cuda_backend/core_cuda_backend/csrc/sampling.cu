// Batched top-k / top-p / min-p sampling with the exponential race, one block per row.
//
// Same semantics as the pytorch backend's sampler (sampling.py) given the same Exp(1) noise:
//   x = logits / temperature;  keep the top-k (ties with the k-th value kept, as HF);  on those, keep the
//   smallest top set whose probability reaches top_p (HF's ascending "cumsum <= 1 - p" rule; the top token
//   always stays);  then drop tokens below min_p x the top probability;  token = argmax(x - log q).
// Rows with temperature <= 0 take argmax(logits). Instead of sorting the vocabulary, the top-k and top-p
// thresholds are found by radix selection over the float bits (4 passes of 8 bits each: counts for top-k,
// probability mass for top-p). Ties at a threshold are kept whole, where a sort would split them
// arbitrarily. Argmax ties go to the lowest index, as torch.argmax.
#include "common.cuh"

namespace core_cuda {

constexpr int kSampleThreads = 1024;

// Monotone map of floats to unsigned keys: a < b  <=>  key(a) < key(b).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct RowView {
  const float* logits;
  float temperature;
  __device__ float operator()(int i) const { return __fdiv_rn(logits[i], temperature); }
};

// Shared state of one row's selection passes.
struct SelectState {
  float hist[256];
  float scratch[33];
  uint32_t prefix;
  float remaining;
  bool found;
};

// Radix selection. kTopDown (top-k): the largest key K with count(key >= K) >= target. Otherwise (top-p):
// the smallest key K with mass(key <= K) > target, mass(i) = exp(x_i - row_max) / norm. Only keys
// >= floor_key take part. Returns found = false when no key qualifies (rounding at the top-p end).
template <bool kTopDown>
__device__ uint32_t radix_select(const RowView& x, int vocab, uint32_t floor_key, float target, float row_max,
                                 float norm, SelectState& st, bool& found) {
  if (threadIdx.x == 0) { st.prefix = 0; st.remaining = target; st.found = true; }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) st.hist[b] = 0.f;
    __syncthreads();
    const uint32_t prefix = st.prefix;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float v = x(i);
      const uint32_t key = order_key(v);
      if (key < floor_key || (key & mask) != prefix || v != v) continue;
      atomicAdd(&st.hist[(key >> shift) & 255u], kTopDown ? 1.f : __expf(v - row_max) / norm);
    }
    __syncthreads();
    if (threadIdx.x == 0 && st.found) {
      float cum = 0.f;
      int chosen = -1;
      for (int step = 0; step < 256; ++step) {
        const int b = kTopDown ? 255 - step : step;
        const bool crosses = kTopDown ? cum + st.hist[b] >= st.remaining : cum + st.hist[b] > st.remaining;
        if (crosses) { chosen = b; break; }
        cum += st.hist[b];
      }
      if (chosen < 0) st.found = false;
      else { st.remaining -= cum; st.prefix |= static_cast<uint32_t>(chosen) << shift; }
    }
    __syncthreads();
    if (!st.found) break;
    mask |= 255u << shift;
  }
  found = st.found;
  return st.prefix;
}

// argmax over kept tokens of score(i); ties go to the lowest index.
template <typename Score>
__device__ int block_argmax(int vocab, Score score, float* best_val_s, int* best_idx_s) {
  float best = -INFINITY;
  int idx = vocab;  // "none yet"
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float s = score(i);
    if (s > best || (idx == vocab && s == best)) { best = s; idx = i; }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, offset);
    if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) { best_val_s[warp] = best; best_idx_s[warp] = idx; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w)
      if (best_val_s[w] > best_val_s[0] || (best_val_s[w] == best_val_s[0] && best_idx_s[w] < best_idx_s[0])) {
        best_val_s[0] = best_val_s[w];
        best_idx_s[0] = best_idx_s[w];
      }
  }
  __syncthreads();
  const int result = best_idx_s[0];
  __syncthreads();
  return result < vocab ? result : 0;
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* __restrict__ logits, int64_t logits_stride, int vocab,
                  const float* __restrict__ temperature, const int64_t* __restrict__ top_k,
                  const float* __restrict__ one_minus_top_p, const float* __restrict__ min_p,
                  const float* __restrict__ noise, int64_t noise_stride, int64_t* __restrict__ out) {
  __shared__ SelectState st;
  __shared__ float best_val_s[32];
  __shared__ int best_idx_s[32];
  const int64_t row = blockIdx.x;
  const float* row_logits = logits + row * logits_stride;
  const float temp = temperature[row];
  if (!(temp > 0.f)) {
    const int token = block_argmax(vocab, [&](int i) { return row_logits[i]; }, best_val_s, best_idx_s);
    if (threadIdx.x == 0) out[row] = token;
    return;
  }
  const RowView x{row_logits, temp};
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) local_max = fmaxf(local_max, x(i));
  const float row_max = block_max(local_max, st.scratch);

  uint32_t floor_key = 0;
  const int64_t k = top_k != nullptr ? top_k[row] : 0;
  if (k > 0 && k < vocab) {
    bool found;
    floor_key = radix_select<true>(x, vocab, 0, static_cast<float>(k), row_max, 1.f, st, found);
  }
  const float omp = one_minus_top_p != nullptr ? one_minus_top_p[row] : 0.f;
  if (omp > 0.f) {
    float local = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float v = x(i);
      if (order_key(v) >= floor_key && v == v) local += __expf(v - row_max);
    }
    const float norm = block_sum(local, st.scratch);
    bool found;
    const uint32_t key = radix_select<false>(x, vocab, floor_key, omp, row_max, norm, st, found);
    floor_key = found ? key : order_key(row_max);
  }
  const float mp = min_p != nullptr ? min_p[row] : 0.f;
  const float* row_noise = noise + row * noise_stride;
  const int token = block_argmax(
      vocab,
      [&](int i) {
        const float v = x(i);
        const bool kept = order_key(v) >= floor_key && (mp <= 0.f || expf(v - row_max) >= mp);
        return kept ? v - logf(fmaxf(row_noise[i], FLT_MIN)) : -INFINITY;
      },
      best_val_s, best_idx_s);
  if (threadIdx.x == 0) out[row] = token;
}

}  // namespace core_cuda

// logits [B, V] float32 (row stride logits_stride); temperature [B] float32; top_k [B] int64 (0 = off),
// one_minus_top_p [B] float32 (0 = off) and min_p [B] float32 (0 = off), each may be null; noise [B, V]
// float32 Exp(1) draws; out [B] int64.
CORE_EXPORT int core_sample(const float* logits, int64_t logits_stride, int num_rows, int vocab,
                            const float* temperature, const int64_t* top_k, const float* one_minus_top_p,
                            const float* min_p, const float* noise, int64_t noise_stride, int64_t* out,
                            cudaStream_t stream) {
  using namespace core_cuda;
  if (num_rows == 0) return kOk;
  if (num_rows < 0 || vocab <= 0) return kBadShape;
  sample_kernel<<<num_rows, kSampleThreads, 0, stream>>>(logits, logits_stride, vocab, temperature, top_k,
                                                          one_minus_top_p, min_p, noise, noise_stride, out);
  return launch_status();
}
