// The host tier's bytes (kv_store/page_directory.h's Tier::kHost): page slots in one host
// allocation, each holding a device page as CacheLayout::StagedBytes stages it. The memory comes
// from an allocator the devices choose (kernels/device_factory.h: pinned where a GPU copies to it,
// otherwise anonymous memory that costs nothing until a slot is written).
// Thread safety: distinct slots may be read and written concurrently; the sequence table decides
// who may touch which slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"

namespace attnd {

// A block of host memory and how to give it back.
struct HostBlock {
  void* ptr = nullptr;
  size_t bytes = 0;
  std::function<void(void*, size_t)> release;
};
using HostAllocator = std::function<absl::StatusOr<HostBlock>(size_t bytes)>;
// Anonymous private memory, mapped lazily (no cost until touched).
HostAllocator AnonymousHostMemory();

// Slots start on 4 KiB boundaries (the disk tier writes them with O_DIRECT).
inline constexpr size_t kTierAlign = 4096;
inline size_t TierStride(size_t bytes) {
  return (bytes + kTierAlign - 1) / kTierAlign * kTierAlign;
}

class HostTier {
 public:
  // `slots` slots of `slot_bytes` (RESOURCE_EXHAUSTED when the allocator cannot give them).
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(size_t slot_bytes, int32_t slots,
                                                          const HostAllocator& allocate);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  int32_t slots() const { return slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t capacity_bytes() const { return static_cast<size_t>(slots_) * slot_bytes_; }
  size_t stride() const { return stride_; }  // bytes from one slot to the next (the room of each)
  uint8_t* Slot(int32_t slot) const {
    return static_cast<uint8_t*>(block_.ptr) + static_cast<size_t>(slot) * stride_;
  }

 private:
  HostTier() = default;
  HostBlock block_;
  size_t slot_bytes_ = 0, stride_ = 0;
  int32_t slots_ = 0;
};

}  // namespace attnd
