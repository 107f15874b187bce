// Moves cache pages between the GPUs of one server with NCCL (one process, ncclCommInitAll).
// NCCL is loaded at run time (libnccl.so.2), so a build or a single-GPU server never needs it;
// when it is missing, callers fall back to cudaMemcpyPeer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace attnd::cuda {

class NcclPeers {
 public:
  // One communicator per GPU ordinal in `ordinals` (ranks in that order). UNAVAILABLE when NCCL
  // cannot be loaded or initialised.
  static absl::StatusOr<std::unique_ptr<NcclPeers>> Create(const std::vector<int>& ordinals);
  ~NcclPeers();

  // Sends `bytes` at `src` (rank `from`'s GPU) into `dst` (rank `to`'s) in one NCCL group,
  // ordered on `from_stream` and `to_stream` (streams of those GPUs); does not wait. Page moves
  // send one staging chunk at a time (kernels/cuda/backend/span_chunks.h).
  absl::Status SendRecv(int from, int to, const void* src, void* dst, size_t bytes,
                        cudaStream_t from_stream, cudaStream_t to_stream);

 private:
  struct Impl;
  NcclPeers() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnd::cuda
