#include "service/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnd {

ShmRegistry::Region::~Region() { munmap(base_, mapped_); }

absl::Status ShmRegistry::Register(const std::string& name, const std::string& key, int64_t offset,
                                   int64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("shared memory: empty region name");
  if (offset < 0 || byte_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("shared memory '", name, "': offset ", offset,
                                                   " and byte_size ", byte_size, " invalid"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count(name))
      return absl::AlreadyExistsError(absl::StrCat("shared memory region '", name, "' exists"));
  }
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0)
    return absl::NotFoundError(
        absl::StrCat("shared memory '", key, "': shm_open: ", std::strerror(errno)));
  struct stat st {};
  // Written so that no sum can overflow, whatever the client sends.
  if (fstat(fd, &st) != 0 || offset > st.st_size || byte_size > st.st_size - offset) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory '", key, "': offset ", offset,
                                                   " + ", byte_size, " bytes beyond its ",
                                                   static_cast<int64_t>(st.st_size), " bytes"));
  }
  // mmap wants a page-aligned offset: map from the page holding `offset`.
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t start = offset / page * page;
  const size_t mapped = static_cast<size_t>(offset - start + byte_size);
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, start);
  close(fd);
  if (base == MAP_FAILED)
    return absl::InternalError(
        absl::StrCat("shared memory '", key, "': mmap: ", std::strerror(errno)));
  auto region = std::make_shared<Region>(base, mapped, static_cast<size_t>(offset - start),
                                         static_cast<size_t>(byte_size));
  std::lock_guard<std::mutex> lock(mu_);
  if (!regions_.emplace(name, std::move(region)).second)
    return absl::AlreadyExistsError(absl::StrCat("shared memory region '", name, "' exists"));
  return absl::OkStatus();
}

absl::Status ShmRegistry::Unregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.erase(name) == 0)
    return absl::NotFoundError(absl::StrCat("shared memory region '", name, "' not registered"));
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::shared_ptr<ShmRegistry::Region>, uint8_t*>> ShmRegistry::Resolve(
    const std::string& what, const std::string& name, int64_t offset, int64_t size) const {
  std::shared_ptr<Region> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(name);
    if (it == regions_.end())
      return absl::NotFoundError(
          absl::StrCat(what, ": shared memory region '", name, "' not registered"));
    r = it->second;
  }
  // Written so that no sum can overflow, whatever the client sends.
  if (offset < 0 || size < 0 || static_cast<uint64_t>(offset) > r->size() ||
      static_cast<uint64_t>(size) > r->size() - static_cast<uint64_t>(offset))
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + ", size,
                                                   " bytes outside region '", name, "' of ",
                                                   r->size(), " bytes"));
  uint8_t* p = r->data() + offset;
  return std::make_pair(std::move(r), p);
}

}  // namespace attnd
