// Paged prefill / extend attention: causal attention of each sequence's new tokens (a whole prompt, a
// chunk of one, or a single decode token in a mixed batch) over its paged context, cached prefix included.
//
// Flash-attention style with an online softmax, on CUDA cores: grid (sequences x query tiles, query
// heads); a block of 4 warps takes kBlockM = 16 query rows (4 per warp), walks the context in tiles of
// kBlockN = 32 keys staged in shared memory as float32, and never materialises the score matrix. Lane j
// scores key j of the tile; lanes then own D / 32 output dimensions each. The grid is sized from the
// host's max_query_len, so blocks past a short sequence's last tile exit at once. Tensor-core (mma)
// tiles would be faster for long prompts; decode, the step that dominates serving, has its own kernel.
#include "paged_attention.cuh"

namespace core_cuda {

constexpr int kPrefillWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kBlockM = kPrefillWarps * kRowsPerWarp;
constexpr int kBlockN = 32;

struct PrefillArgs {
  const void* q; int64_t q_token_stride, q_head_stride;
  const void* k_cache; const void* v_cache; const int32_t* block_tables; int max_blocks_per_seq;
  const int32_t* query_start_loc; const int32_t* seq_lens; void* out;
  int num_seqs, num_q_heads, num_kv_heads, block_size; float scale; int window, tiles_per_seq;
};

template <typename T, int D>
__global__ void __launch_bounds__(kPrefillWarps * 32) paged_prefill_kernel(PrefillArgs a) {
  constexpr int kPerLane = D / 32;
  __shared__ float q_s[kBlockM][D];
  __shared__ float k_s[kBlockN][D + 1];  // +1: lane j reads row j without bank conflicts
  __shared__ float v_s[kBlockN][D];

  const int seq = blockIdx.x / a.tiles_per_seq, m0 = (blockIdx.x % a.tiles_per_seq) * kBlockM;
  const int head = blockIdx.y, kv_head = head / (a.num_q_heads / a.num_kv_heads);
  const int q_start = a.query_start_loc[seq], q_len = a.query_start_loc[seq + 1] - q_start;
  if (m0 >= q_len) return;  // uniform over the block
  const int context = a.seq_lens[seq] - q_len;
  const int rows = min(kBlockM, q_len - m0);
  const int first_pos = context + m0, last_pos = context + m0 + rows - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(a.q);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int64_t row_stride = static_cast<int64_t>(a.num_kv_heads) * D;

  for (int i = threadIdx.x; i < kBlockM * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    q_s[r][d] = r < rows ? to_float(q[(q_start + m0 + r) * a.q_token_stride + head * a.q_head_stride + d]) * a.scale
                         : 0.f;
  }
  float m_i[kRowsPerWarp], l_i[kRowsPerWarp], acc[kRowsPerWarp][kPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m_i[r] = -INFINITY;
    l_i[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[r][i] = 0.f;
  }

  const int kv_lo = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;
  for (int n0 = kv_lo; n0 <= last_pos; n0 += kBlockN) {
    __syncthreads();  // the previous tile is fully consumed (and q_s written on the first pass)
    for (int i = threadIdx.x; i < kBlockN * D; i += blockDim.x) {
      const int j = i / D, d = i % D, t = n0 + j;
      float kv = 0.f, vv = 0.f;
      if (t <= last_pos) {
        const int64_t at = context_slot(table, t, a.block_size) * row_stride + kv_head * D + d;
        kv = to_float(k_cache[at]);
        vv = to_float(v_cache[at]);
      }
      k_s[j][d] = kv;
      v_s[j][d] = vv;
    }
    __syncthreads();

    float p[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) p[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float kd = k_s[lane][d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) p[r] += q_s[warp * kRowsPerWarp + r][d] * kd;
    }
    const int t = n0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r, pos = first_pos + row;
      const bool valid = row < rows && t <= pos && (a.window <= 0 || t > pos - a.window);
      const float s = valid ? p[r] : -INFINITY;
      const float m_new = fmaxf(m_i[r], warp_max(s));
      const float alpha = m_i[r] == -INFINITY ? 0.f : __expf(m_i[r] - m_new);
      p[r] = valid ? __expf(s - m_new) : 0.f;
      l_i[r] = l_i[r] * alpha + warp_sum(p[r]);
      m_i[r] = m_new;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[r][i] *= alpha;
    }
#pragma unroll 4
    for (int j = 0; j < kBlockN; ++j) {
      float v[kPerLane];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = v_s[j][lane + 32 * i];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float pj = __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[r][i] += pj * v[i];
      }
    }
  }

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = warp * kRowsPerWarp + r;
    if (row >= rows) continue;
    const int64_t base = (static_cast<int64_t>(q_start + m0 + row) * a.num_q_heads + head) * D;
    const float inv = l_i[r] > 0.f ? 1.f / l_i[r] : 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) out[base + lane + 32 * i] = from_float<T>(acc[r][i] * inv);
  }
}

}  // namespace core_cuda

// q [T, Hq, D] (any token / head strides), out [T, Hq, D] contiguous; query_start_loc [S + 1] and
// seq_lens [S] int32 on the device; max_query_len sizes the grid.
CORE_EXPORT int core_paged_prefill_attention(const void* q, int64_t q_token_stride, int64_t q_head_stride,
                                             const void* k_cache, const void* v_cache,
                                             const int32_t* block_tables, int max_blocks_per_seq,
                                             const int32_t* query_start_loc, const int32_t* seq_lens,
                                             void* out, int num_seqs, int max_query_len, int num_q_heads,
                                             int num_kv_heads, int head_dim, int block_size, float scale,
                                             int window, int dtype, cudaStream_t stream) {
  using namespace core_cuda;
  if (num_seqs == 0 || max_query_len == 0) return kOk;
  if (num_seqs < 0 || max_query_len < 0 || num_kv_heads <= 0 || block_size <= 0) return kBadShape;
  if (num_q_heads % num_kv_heads) return kBadGroupSize;
  const int tiles = (max_query_len + kBlockM - 1) / kBlockM;
  const PrefillArgs args{q, q_token_stride, q_head_stride, k_cache, v_cache, block_tables, max_blocks_per_seq,
                         query_start_loc, seq_lens, out, num_seqs, num_q_heads, num_kv_heads, block_size,
                         scale, window, tiles};
  const dim3 grid(num_seqs * tiles, num_q_heads);
  CORE_DISPATCH_DTYPE(dtype, {
    CORE_DISPATCH_HEAD_DIM(head_dim, {
      paged_prefill_kernel<scalar_t, kHeadDim><<<grid, kPrefillWarps * 32, 0, stream>>>(args);
    });
  });
  return launch_status();
}
