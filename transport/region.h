// The one transport interface inside attnd, shaped like NIXL's: memory registered once under a
// name (a region), descriptors naming bytes in it (region, offset, size, transfer), a READ of a
// peer's bytes into the server and a WRITE of the server's bytes to a peer, each tied to a
// notification (the transfer id) the other side waits on. docs/data-plane.md.
//
// Backends: POSIX shared memory (service/shm_registry.h: pread/pwrite on the client's object,
// transfer ids unused) and UCX (transport/ucx_plane.h: the client writes into server memory, the
// server writes into client memory, each landing announced by its transfer id). Tensors sent in
// the gRPC message itself are the degenerate case, viewed in place (service/tensor_codec.h).
// A new backend (NIXL, Mooncake's transfer engine) implements Region and resolves its names in
// ShmAccess::Resolve; the engine never sees which one moved the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnd {

class Region {
 public:
  virtual ~Region() = default;
  virtual const std::string& name() const = 0;
  virtual int64_t size() const = 0;
  // READ: [offset, offset + n) of the region into dst, once `transfer` landed there, waiting for
  // it until `deadline` at most (a backend without notifications ignores both). The range is
  // bounds-checked by whoever resolved the region.
  virtual absl::Status Read(int64_t offset, void* dst, size_t n, uint64_t transfer,
                            absl::Time deadline) const = 0;
  // The notification: runs `ready` once `transfer` has landed here, or failed to (refused, the
  // peer lost, or not come within the backend's timeout: then Read and View of it fail at once),
  // inline when it already has or the backend has no notifications. `ready` may run on a
  // transport thread and must not block. The service waits so for a call's inputs before the
  // call takes an executor thread, and then reads them with a deadline of now.
  virtual void WhenLanded(uint64_t transfer, std::function<void()> ready) const { ready(); }
  // WRITE: n bytes at src into [offset, offset + n), the peer notified with `transfer`. May
  // return before they arrive when src is the region's own Staging (the UCX plane: the client
  // waits for the landing; a failed delivery makes the region's later calls fail).
  virtual absl::Status Write(int64_t offset, const void* src, size_t n,
                             uint64_t transfer) const = 0;
  // FAILED_PRECONDITION (or UNAVAILABLE for a lost peer; INVALID_ARGUMENT for a region outputs
  // never go to) unless [offset, offset + n) can still be written: checked before a layer runs,
  // so that a step does not commit an output it cannot deliver.
  virtual absl::Status CheckStillCovers(int64_t offset, size_t n) const = 0;

  // Zero-copy forms, for backends whose bytes sit in server memory. View: where [offset, +n)
  // of `transfer` can be read in place (valid while this region is held), once it landed
  // (waiting until `deadline` at most, as Read); null
  // when the backend has no such view (then Read). Staging: where an output bound for
  // [offset, +n) may be built, to be passed to Write as `src`; null when none (then any buffer).
  virtual absl::StatusOr<const char*> View(int64_t offset, size_t n, uint64_t transfer,
                                           absl::Time deadline) const {
    return nullptr;
  }
  virtual char* Staging(int64_t offset, size_t n) const { return nullptr; }
};

}  // namespace attnd
