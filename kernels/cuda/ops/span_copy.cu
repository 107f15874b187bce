// Tables of byte spans copied by one kernel: page moves on one GPU, and the gather into and
// scatter out of the staging buffer of page moves between GPUs
// (kernels/cuda/backend/span_chunks.h).
#include "kernels/cuda/ops/cuda_common.cuh"
#include "kernels/cuda/ops/cuda_kernels.h"

namespace attnd::cuda {
namespace {

// Blocks take spans in turn (grid-stride); a block's threads copy 16 bytes each where the span
// is 16-byte aligned at both ends and a multiple of 16 long, else a byte each.
__global__ void CopySpansKernel(const SpanCopy* table, int64_t count) {
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const SpanCopy s = table[i];
    const bool wide = ((reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) |
                        static_cast<uintptr_t>(s.bytes)) &
                       15) == 0;
    if (wide) {
      const uint4* src = reinterpret_cast<const uint4*>(s.src);
      uint4* dst = reinterpret_cast<uint4*>(s.dst);
      for (uint64_t j = threadIdx.x; j < s.bytes / 16; j += blockDim.x) dst[j] = src[j];
    } else {
      for (uint64_t j = threadIdx.x; j < s.bytes; j += blockDim.x) s.dst[j] = s.src[j];
    }
  }
}

}  // namespace

cudaError_t LaunchCopySpans(const SpanCopy* table, int64_t count, cudaStream_t s) {
  if (count <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(count < 65535 ? count : 65535);
  CopySpansKernel<<<blocks, kThreads, 0, s>>>(table, count);
  return cudaGetLastError();
}

}  // namespace attnd::cuda
