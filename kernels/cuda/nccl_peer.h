// Moves cache pages between the GPUs of one server with NCCL (one process, ncclCommInitAll).
// NCCL is loaded at run time (libnccl.so.2), so a build or a single-GPU server never needs it;
// when it is missing, callers fall back to cudaMemcpyPeer.
#pragma once

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

  // One transfer: `bytes` from `src` on rank `from` to `dst` on rank `to`.
  struct Transfer {
    const void* src;
    void* dst;
    size_t bytes;
  };
  // Sends every transfer from rank `from` to rank `to` in one NCCL group and waits for them.
  absl::Status Move(int from, int to, const std::vector<Transfer>& transfers);

 private:
  struct Impl;
  NcclPeers() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnd::cuda
