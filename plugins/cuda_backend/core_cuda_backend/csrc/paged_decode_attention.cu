// Paged decode attention: one new query token per sequence over its whole cached context.
//
// Grid (sequences, KV heads, context splits); a block serves the G query heads that share one KV head, so
// each K/V row is read once for the whole group (grouped-query attention). The context is cut into
// partitions of kPartition tokens; with more than one split each block writes an unnormalised partial
// result (float32 accumulator, running max and sum) and core_paged_decode_reduce combines them. The number
// of splits comes from the host (ceil(max_seq_len / kPartition)) and sequences shorter than the grid just
// leave their extra splits empty, so one captured CUDA graph serves every length up to that bound.
#include "paged_attention.cuh"

namespace core_cuda {

constexpr int kPartition = 512;
constexpr int kDecodeWarps = 4;

template <typename T, int D, int G>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    paged_decode_kernel(const T* __restrict__ q, int64_t q_token_stride, int64_t q_head_stride,
                        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                        const int32_t* __restrict__ block_tables, int max_blocks_per_seq,
                        const int32_t* __restrict__ seq_lens, T* __restrict__ out,
                        float* __restrict__ part_acc, float* __restrict__ part_max,
                        float* __restrict__ part_sum, int num_kv_heads, int group, int block_size,
                        float scale, int window, int num_splits) {
  constexpr int kLanesPerToken = D / 8;  // each lane holds 8 dimensions of one token
  constexpr int kTokensPerWarp = 32 / kLanesPerToken;
  constexpr int kTokensPerStep = kDecodeWarps * kTokensPerWarp;
  __shared__ __align__(16) float q_s[G][D];  // scaled queries; reused for the cross-warp output sum
  __shared__ float logits[G][kPartition];
  __shared__ float head_max[G], head_sum[G];

  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int num_q_heads = num_kv_heads * group;
  const int seq_len = seq_lens[seq];
  const int part0 = split * kPartition;
  if (part0 >= seq_len) return;  // past this sequence's context: the reduce kernel never reads it
  const int start = max(part0, window > 0 ? seq_len - window : 0);
  const int end = min(part0 + kPartition, seq_len);
  if (start >= end) {  // wholly outside the sliding window: an empty partial result
    for (int g = threadIdx.x; g < group; g += blockDim.x) {
      const int64_t part_row = (static_cast<int64_t>(seq) * num_q_heads + kv_head * group + g) * num_splits + split;
      part_max[part_row] = -FLT_MAX;
      part_sum[part_row] = 0.f;
    }
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int d0 = (lane % kLanesPerToken) * 8;
  const int token_in_step = warp * kTokensPerWarp + lane / kLanesPerToken;
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int64_t row_stride = static_cast<int64_t>(num_kv_heads) * D;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * D + d0;

  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    q_s[g][d] = g < group ? to_float(q[seq * q_token_stride + (kv_head * group + g) * q_head_stride + d]) * scale
                          : 0.f;
  }
  __syncthreads();

  // Scores of every context token of this partition, for every head of the group.
  for (int base = start; base < end; base += kTokensPerStep) {
    const int t = base + token_in_step;
    float k[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (t < end) load8(k_cache + context_slot(table, t, block_size) * row_stride + head_offset, k);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) break;
      const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][d0]);
      const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][d0 + 4]);
      float s = qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] + qb.x * k[4] + qb.y * k[5] +
                qb.z * k[6] + qb.w * k[7];
#pragma unroll
      for (int offset = kLanesPerToken / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (t < end && lane % kLanesPerToken == 0) logits[g][t - part0] = s;
    }
  }
  __syncthreads();

  // Softmax numerators in place; one warp per head.
  for (int g = warp; g < group; g += kDecodeWarps) {
    float m = -FLT_MAX;
    for (int i = start - part0 + lane; i < end - part0; i += 32) m = fmaxf(m, logits[g][i]);
    m = warp_max(m);
    float s = 0.f;
    for (int i = start - part0 + lane; i < end - part0; i += 32) {
      const float e = __expf(logits[g][i] - m);
      logits[g][i] = e;
      s += e;
    }
    s = warp_sum(s);
    if (lane == 0) { head_max[g] = m; head_sum[g] = s; }
  }
  __syncthreads();

  // Weighted sum of V rows; each lane keeps its 8 dimensions of every head.
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  for (int base = start; base < end; base += kTokensPerStep) {
    const int t = base + token_in_step;
    if (t >= end) continue;
    float v[8];
    load8(v_cache + context_slot(table, t, block_size) * row_stride + head_offset, v);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) break;
      const float p = logits[g][t - part0];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] += p * v[i];
    }
  }
  // Lanes holding the same dimensions (different tokens) sum within the warp, then across warps.
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int offset = kLanesPerToken; offset < 32; offset <<= 1)
        acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], offset);
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q_s[i / D][i % D] = 0.f;
  __syncthreads();
  if (lane < kLanesPerToken) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) break;
#pragma unroll
      for (int i = 0; i < 8; ++i) atomicAdd(&q_s[g][d0 + i], acc[g][i]);
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    const int64_t head_row = static_cast<int64_t>(seq) * num_q_heads + kv_head * group + g;
    if (num_splits == 1) {
      const float sum = head_sum[g];
      out[head_row * D + d] = from_float<T>(sum > 0.f ? q_s[g][d] / sum : 0.f);
    } else {
      const int64_t part_row = head_row * num_splits + split;
      part_acc[part_row * D + d] = q_s[g][d];
      if (d == 0) { part_max[part_row] = head_max[g]; part_sum[part_row] = head_sum[g]; }
    }
  }
}

// Combines the splits of each (sequence, head): out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) s_i,
// over the ceil(seq_len / kPartition) splits the sequence's context covers.
template <typename T>
__global__ void paged_decode_reduce_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_max,
                                           const float* __restrict__ part_sum, const int32_t* __restrict__ seq_lens,
                                           T* __restrict__ out, int num_heads, int head_dim, int num_splits) {
  const int64_t head_row = blockIdx.x;
  const int used = min(num_splits, (seq_lens[head_row / num_heads] + kPartition - 1) / kPartition);
  const float* maxes = part_max + head_row * num_splits;
  const float* sums = part_sum + head_row * num_splits;
  float m = -FLT_MAX;
  for (int i = 0; i < used; ++i) if (sums[i] > 0.f) m = fmaxf(m, maxes[i]);
  float total = 0.f;
  for (int i = 0; i < used; ++i) if (sums[i] > 0.f) total += __expf(maxes[i] - m) * sums[i];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int i = 0; i < used; ++i)
      if (sums[i] > 0.f) acc += __expf(maxes[i] - m) * part_acc[(head_row * num_splits + i) * head_dim + d];
    out[head_row * head_dim + d] = from_float<T>(total > 0.f ? acc / total : 0.f);
  }
}

// The launch arguments that do not depend on the template parameters.
struct DecodeArgs {
  const void* q; int64_t q_token_stride, q_head_stride;
  const void* k_cache; const void* v_cache; const int32_t* block_tables; int max_blocks_per_seq;
  const int32_t* seq_lens; void* out; float* part_acc; float* part_max; float* part_sum;
  int num_seqs, num_kv_heads, group, block_size; float scale; int window, num_splits;
};

template <typename T, int D, int G>
void launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  const dim3 grid(a.num_seqs, a.num_kv_heads, a.num_splits);
  paged_decode_kernel<T, D, G><<<grid, kDecodeWarps * 32, 0, stream>>>(
      static_cast<const T*>(a.q), a.q_token_stride, a.q_head_stride, static_cast<const T*>(a.k_cache),
      static_cast<const T*>(a.v_cache), a.block_tables, a.max_blocks_per_seq, a.seq_lens,
      static_cast<T*>(a.out), a.part_acc, a.part_max, a.part_sum, a.num_kv_heads, a.group, a.block_size,
      a.scale, a.window, a.num_splits);
  if (a.num_splits > 1) {
    paged_decode_reduce_kernel<T><<<a.num_seqs * a.num_kv_heads * a.group, D, 0, stream>>>(
        a.part_acc, a.part_max, a.part_sum, a.seq_lens, static_cast<T*>(a.out), a.num_kv_heads * a.group, D,
        a.num_splits);
  }
}

// Picks the smallest compiled group size (1, 2, 4, 8, 16) that holds `group` query heads.
template <typename T, int D>
void launch_decode_for_group(const DecodeArgs& a, cudaStream_t stream) {
  if (a.group == 1) launch_decode<T, D, 1>(a, stream);
  else if (a.group == 2) launch_decode<T, D, 2>(a, stream);
  else if (a.group <= 4) launch_decode<T, D, 4>(a, stream);
  else if (a.group <= 8) launch_decode<T, D, 8>(a, stream);
  else launch_decode<T, D, 16>(a, stream);
}

}  // namespace core_cuda

// The context partition size: the caller sizes the split workspace with it.
CORE_EXPORT int core_paged_decode_partition_size() { return core_cuda::kPartition; }

// q [S, Hq, D] (any token / head strides); out [S, Hq, D] contiguous; the part_* workspaces are float32
// [S, Hq, num_splits, D] and [S, Hq, num_splits] (unused, may be null, when num_splits == 1).
CORE_EXPORT int core_paged_decode_attention(const void* q, int64_t q_token_stride, int64_t q_head_stride,
                                            const void* k_cache, const void* v_cache,
                                            const int32_t* block_tables, int max_blocks_per_seq,
                                            const int32_t* seq_lens, void* out, float* part_acc,
                                            float* part_max, float* part_sum, int num_seqs, int num_q_heads,
                                            int num_kv_heads, int head_dim, int block_size, float scale,
                                            int window, int num_splits, int dtype, cudaStream_t stream) {
  using namespace core_cuda;
  if (num_seqs == 0) return kOk;
  if (num_seqs < 0 || num_kv_heads <= 0 || block_size <= 0 || num_splits <= 0) return kBadShape;
  if (num_q_heads % num_kv_heads) return kBadGroupSize;
  const int group = num_q_heads / num_kv_heads;
  if (group > 16) return kBadGroupSize;
  const DecodeArgs args{q, q_token_stride, q_head_stride, k_cache, v_cache, block_tables, max_blocks_per_seq,
                        seq_lens, out, part_acc, part_max, part_sum, num_seqs, num_kv_heads, group,
                        block_size, scale, window, num_splits};
  CORE_DISPATCH_DTYPE(dtype, { CORE_DISPATCH_HEAD_DIM(head_dim, { launch_decode_for_group<scalar_t, kHeadDim>(args, stream); }); });
  return launch_status();
}
