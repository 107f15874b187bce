// Registered POSIX shared-memory regions of co-located clients: layer tensors are read from and
// outputs written to them without crossing the gRPC transport (docs/wire-protocol.md). Thread safe.
//
// The server never maps a client's object: a mapped object that its owner truncates turns the
// next access into SIGBUS, which would kill every sequence of every client. Regions are read and
// written with pread/pwrite on a descriptor held open instead, so an object that shrinks or
// vanishes fails only the call that uses it (docs/trust.md). A region stays usable while a request
// holds it, even after it is unregistered.
//
// Trust (docs/trust.md): regions live in their tenant's namespace; only objects under the allowed
// name prefix and owned by the calling process's user are opened (the service learns that user
// from the Unix socket's peer credentials); each tenant holds at most its quota of regions.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "transport/region.h"

namespace attnd {

namespace transport {
class UcxPlane;
}

class ShmRegistry {
 public:
  // An open region; the descriptor closes when the last holder lets go.
  class Region final : public attnd::Region {
   public:
    Region(std::string name, int fd, int64_t offset, int64_t size)
        : name_(std::move(name)), fd_(fd), offset_(offset), size_(size) {}
    ~Region();
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;
    const std::string& name() const override { return name_; }
    int64_t size() const override { return size_; }
    // [offset, offset + n) of the region (already bounds-checked by Resolve); no transfer ids
    // (the bytes are there when the call comes). Read is FAILED_PRECONDITION when the object no
    // longer holds those bytes (it shrank); Write grows an object that shrank back to size and
    // fails only on an I/O error.
    absl::Status Read(int64_t offset, void* dst, size_t n, uint64_t transfer,
                      absl::Time deadline) const override;
    absl::Status Write(int64_t offset, const void* src, size_t n, uint64_t transfer) const override;
    // FAILED_PRECONDITION unless the object still holds [offset, offset + n) of the region.
    absl::Status CheckStillCovers(int64_t offset, size_t n) const override;

   private:
    std::string name_;
    int fd_;
    int64_t offset_, size_;  // the region inside the object
  };

  // max_regions: registrations held at once, all tenants (RESOURCE_EXHAUSTED beyond); `prefix`:
  // the object names (keys) that may be opened start with it.
  explicit ShmRegistry(int max_regions = 64, std::string prefix = "/attnd-")
      : max_regions_(max_regions), prefix_(std::move(prefix)) {}

  // Opens [offset, offset + byte_size) of the shared-memory object `key` read-write as `tenant`'s
  // region `name`, when the object is owned by `owner` (the caller's uid). ALREADY_EXISTS (name),
  // NOT_FOUND (no such object), PERMISSION_DENIED (outside the prefix, owned by another user, not
  // a regular object), INVALID_ARGUMENT (bad name or key, range beyond the object),
  // RESOURCE_EXHAUSTED (the server's limit, or the tenant's `tenant_limit` when > 0).
  absl::Status Register(const std::string& tenant, const std::string& name, const std::string& key,
                        int64_t offset, int64_t byte_size, uid_t owner, int64_t tenant_limit = 0);
  absl::Status Unregister(const std::string& tenant, const std::string& name);
  // `tenant`'s region `name`, after checking that [offset, offset + size) lies inside it. `what`
  // names the tensor in errors.
  absl::StatusOr<std::shared_ptr<const Region>> Resolve(const std::string& tenant,
                                                        const std::string& what,
                                                        const std::string& name, int64_t offset,
                                                        int64_t size) const;
  int num_regions() const;
  int regions_of(const std::string& tenant) const;
  const std::string& prefix() const { return prefix_; }

 private:
  using Key = std::pair<std::string, std::string>;  // (tenant, name)
  const int max_regions_;
  const std::string prefix_;
  mutable std::mutex mu_;
  std::map<Key, std::shared_ptr<const Region>> regions_;
  std::map<std::string, int> per_tenant_;
};

// One caller's view of the regions a layer call may name: its tenant's shared-memory regions
// (or a refusal of any shared-memory use: shared memory off, or a caller not on the Unix socket)
// and its tenant's data plane regions ("ucx-..." names; any listener).
struct ShmAccess {
  const ShmRegistry* registry = nullptr;
  std::string tenant;
  absl::Status refused;  // non-OK: every reference to a shared-memory region answers this
  const transport::UcxPlane* plane = nullptr;  // null: the data plane is off
  // INVALID_ARGUMENT as well for a transfer id on a shared-memory region, or none on a data
  // plane's.
  absl::StatusOr<std::shared_ptr<const Region>> Resolve(const std::string& what,
                                                        const std::string& name, int64_t offset,
                                                        int64_t size, uint64_t transfer) const;
};

}  // namespace attnd
