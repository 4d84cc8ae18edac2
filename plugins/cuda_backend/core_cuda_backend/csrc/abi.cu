// The library's own entry points: ABI version and error text for the status codes the kernels return.
#include "common.cuh"

// Bumped whenever an exported signature changes; library.py refuses a library of another version.
CORE_EXPORT int core_abi_version() { return 1; }

// Text of a status returned by any core_* function (0, a negative CoreStatus or a cudaError_t).
CORE_EXPORT const char* core_status_string(int status) {
  switch (status) {
    case core_cuda::kOk: return "ok";
    case core_cuda::kBadDType: return "unsupported dtype (float32, float16 or bfloat16)";
    case core_cuda::kBadHeadDim: return "unsupported head size (64 or 128)";
    case core_cuda::kBadGroupSize: return "query heads must be a multiple of KV heads, at most 16 per KV head";
    case core_cuda::kBadShape: return "invalid sizes";
    default: return cudaGetErrorString(static_cast<cudaError_t>(status));
  }
}
