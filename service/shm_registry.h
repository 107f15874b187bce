// Registered POSIX shared-memory regions of co-located clients: tensors are read from and outputs
// written to them without crossing the gRPC transport (DESIGN §7). Thread safe; a region stays
// mapped while any request still uses it, even after it is unregistered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"

namespace attnd {

class ShmRegistry {
 public:
  // A mapped region; unmapped when the last holder lets go.
  class Region {
   public:
    Region(void* base, size_t mapped, size_t offset, size_t size)
        : base_(base), mapped_(mapped), offset_(offset), size_(size) {}
    ~Region();
    uint8_t* data() const { return static_cast<uint8_t*>(base_) + offset_; }
    size_t size() const { return size_; }

   private:
    void* base_;
    size_t mapped_, offset_, size_;
  };

  // Maps [offset, offset + byte_size) of the shared-memory object `key` read-write.
  // ALREADY_EXISTS (name), NOT_FOUND (no such object), INVALID_ARGUMENT (range beyond it).
  absl::Status Register(const std::string& name, const std::string& key, int64_t offset,
                        int64_t byte_size);
  absl::Status Unregister(const std::string& name);
  // The bytes [offset, offset + size) of region `name`, and the region to hold while using them.
  // `what` names the tensor in errors.
  absl::StatusOr<std::pair<std::shared_ptr<Region>, uint8_t*>> Resolve(const std::string& what,
                                                                       const std::string& name,
                                                                       int64_t offset,
                                                                       int64_t size) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Region>> regions_;
};

}  // namespace attnd
