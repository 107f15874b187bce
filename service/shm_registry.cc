#include "service/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>  // shm_open
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "transport/ucx_plane.h"

namespace attnd {
namespace {

constexpr size_t kMaxNameBytes = 255;  // NAME_MAX: longer shm keys cannot exist

// Loops over short transfers; a transfer that makes no progress means the object ended.
template <typename Op>
absl::Status Transfer(const std::string& region, const char* verb, int64_t pos, size_t n, Op op) {
  size_t done = 0;
  while (done < n) {
    const ssize_t k = op(done, pos + static_cast<int64_t>(done));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return absl::FailedPreconditionError(absl::StrCat(
          "shared memory region ", Quote(region), ": could ", verb, " only ", done, " of ", n,
          " bytes",
          k < 0 ? absl::StrCat(" (", std::strerror(errno), ")") : " (the object shrank)"));
    done += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

}  // namespace

ShmRegistry::Region::~Region() { close(fd_); }

absl::Status ShmRegistry::Region::CheckStillCovers(int64_t offset, size_t n) const {
  struct stat st {};
  if (fstat(fd_, &st) != 0 || st.st_size < offset_ + offset + static_cast<int64_t>(n))
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory region ", Quote(name_), ": the object shrank to ",
        static_cast<int64_t>(st.st_size), " bytes; the region needs ", offset_ + offset + n));
  return absl::OkStatus();
}

absl::Status ShmRegistry::Region::Read(int64_t offset, void* dst, size_t n, uint64_t,
                                       absl::Time) const {
  char* d = static_cast<char*>(dst);
  return Transfer(name_, "read", offset_ + offset, n,
                  [&](size_t done, int64_t pos) { return pread(fd_, d + done, n - done, pos); });
}

absl::Status ShmRegistry::Region::Write(int64_t offset, const void* src, size_t n, uint64_t) const {
  // No size check here: pwrite past the end of an object that shrank grows it back (never a
  // fault), and by now the layer ran, so only a real I/O error may fail the write.
  const char* s = static_cast<const char*>(src);
  return Transfer(name_, "write", offset_ + offset, n,
                  [&](size_t done, int64_t pos) { return pwrite(fd_, s + done, n - done, pos); });
}

absl::Status ShmRegistry::Register(const std::string& tenant, const std::string& name,
                                   const std::string& key, int64_t offset, int64_t byte_size,
                                   uid_t owner, int64_t tenant_limit) {
  if (name.empty()) return absl::InvalidArgumentError("shared memory: empty region name");
  if (name.size() > kMaxNameBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region name ", Quote(name), ": longer than ", kMaxNameBytes));
  if (transport::UcxPlane::Names(name))
    return absl::InvalidArgumentError(absl::StrCat("shared memory region name ", Quote(name),
                                                   ": names starting \"ucx-\" are the data "
                                                   "plane's"));
  if (key.empty() || key.size() > kMaxNameBytes || key.find('\0') != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("shared memory key ", Quote(key),
                                                   ": must be 1 to ", kMaxNameBytes,
                                                   " bytes with no NUL byte"));
  // One path component under /dev/shm, inside the allowed prefix.
  if (key.rfind(prefix_, 0) != 0 || key[0] != '/' || key.find('/', 1) != std::string::npos ||
      key == "/." || key == "/..")
    return absl::PermissionDeniedError(
        absl::StrCat("shared memory key ", Quote(key), ": only objects named ", Quote(prefix_),
                     "... (one component) may be used (--shm-prefix)"));
  if (offset < 0 || byte_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("shared memory region ", Quote(name),
                                                   ": offset ", offset, " and byte_size ",
                                                   byte_size, " invalid"));
  auto full = [&]() -> absl::Status {  // mu_ held
    if (regions_.count({tenant, name}))
      return absl::AlreadyExistsError(
          absl::StrCat("shared memory region ", Quote(name), " exists"));
    if (static_cast<int>(regions_.size()) >= max_regions_)
      return absl::ResourceExhaustedError(absl::StrCat(
          "shared memory: ", max_regions_, " regions registered, the limit (--max-shm-regions)"));
    auto it = per_tenant_.find(tenant);
    const int held = it == per_tenant_.end() ? 0 : it->second;
    if (tenant_limit > 0 && held >= tenant_limit)
      return absl::ResourceExhaustedError(
          absl::StrCat("tenant quota shm-regions: holds ", held, " of ", tenant_limit,
                       ", needs 1 more (--quota-shm-regions or the token file's shm-regions=)"));
    return absl::OkStatus();
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = full(); !s.ok()) return s;
  }
  // shm_open adds O_NOFOLLOW: a symbolic link planted under /dev/shm is not followed.
  const int fd = shm_open(key.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0)
    return absl::NotFoundError(
        absl::StrCat("shared memory ", Quote(key), ": shm_open: ", std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != owner) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "shared memory ", Quote(key), ": not a shared-memory object owned by the calling user"));
  }
  // Written so that no sum can overflow, whatever the client sends.
  if (offset > st.st_size || byte_size > st.st_size - offset) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory ", Quote(key), ": offset ",
                                                   offset, " + ", byte_size, " bytes beyond its ",
                                                   static_cast<int64_t>(st.st_size), " bytes"));
  }
  auto region = std::make_shared<const Region>(name, fd, offset, byte_size);
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = full(); !s.ok()) return s;
  regions_.emplace(Key{tenant, name}, std::move(region));
  ++per_tenant_[tenant];
  return absl::OkStatus();
}

absl::Status ShmRegistry::Unregister(const std::string& tenant, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.erase({tenant, name}) == 0)
    return absl::NotFoundError(
        absl::StrCat("shared memory region ", Quote(name), " not registered"));
  if (--per_tenant_[tenant] == 0) per_tenant_.erase(tenant);
  return absl::OkStatus();
}

int ShmRegistry::num_regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(regions_.size());
}

int ShmRegistry::regions_of(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second;
}

absl::StatusOr<std::shared_ptr<const ShmRegistry::Region>> ShmRegistry::Resolve(
    const std::string& tenant, const std::string& what, const std::string& name, int64_t offset,
    int64_t size) const {
  std::shared_ptr<const Region> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find({tenant, name});
    if (it == regions_.end())
      return absl::NotFoundError(
          absl::StrCat(what, ": shared memory region ", Quote(name), " not registered"));
    r = it->second;
  }
  // Written so that no sum can overflow, whatever the client sends.
  if (offset < 0 || size < 0 || offset > r->size() || size > r->size() - offset)
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + ", size,
                                                   " bytes outside region ", Quote(name), " of ",
                                                   r->size(), " bytes"));
  return r;
}

absl::StatusOr<std::shared_ptr<const Region>> ShmAccess::Resolve(const std::string& what,
                                                                 const std::string& name,
                                                                 int64_t offset, int64_t size,
                                                                 uint64_t transfer) const {
  if (transport::UcxPlane::Names(name)) {
    if (plane == nullptr)
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": region ", Quote(name),
                       " is a data plane's, and the data plane is off on this "
                       "server (--data-plane)"));
    if (transfer == 0)
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a data plane region needs the transfer id of its bytes"));
    return plane->Resolve(tenant, what, name, offset, size);
  }
  if (transfer != 0)
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": transfer is for data plane regions; shared memory takes none"));
  if (!refused.ok())
    return absl::Status(refused.code(), absl::StrCat(what, ": ", refused.message()));
  return registry->Resolve(tenant, what, name, offset, size);
}

}  // namespace attnd
