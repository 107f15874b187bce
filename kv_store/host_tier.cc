#include "kv_store/host_tier.h"

#include <sys/mman.h>

#include "absl/strings/str_cat.h"

namespace attnd {

HostAllocator AnonymousHostMemory() {
  return [](size_t bytes) -> absl::StatusOr<HostBlock> {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      return absl::ResourceExhaustedError(
          absl::StrCat("host tier: cannot map ", bytes, " bytes of host memory"));
    return HostBlock{p, bytes, [](void* q, size_t n) { munmap(q, n); }};
  };
}

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(size_t slot_bytes, int32_t slots,
                                                           const HostAllocator& allocate) {
  std::unique_ptr<HostTier> t(new HostTier());
  t->slot_bytes_ = slot_bytes;
  t->stride_ = TierStride(slot_bytes);
  t->slots_ = slots < 0 ? 0 : slots;
  if (t->slots_ == 0) return t;
  auto block = allocate(t->stride_ * static_cast<size_t>(t->slots_));
  if (!block.ok()) return block.status();
  t->block_ = std::move(block).value();
  return t;
}

HostTier::~HostTier() {
  if (block_.ptr != nullptr && block_.release) block_.release(block_.ptr, block_.bytes);
}

}  // namespace attnd
