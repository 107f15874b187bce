#include "kv_store/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "kv_store/host_tier.h"

namespace attnd {
namespace {

// An aligned buffer of `bytes` for O_DIRECT transfers of unaligned callers' data.
struct Bounce {
  uint8_t* p = nullptr;
  size_t bytes = 0;
  uint8_t* Get(size_t n) {
    if (n > bytes) {
      std::free(p);
      p = static_cast<uint8_t*>(std::aligned_alloc(kTierAlign, TierStride(n)));
      bytes = p ? TierStride(n) : 0;
    }
    return p;
  }
  ~Bounce() { std::free(p); }
};
thread_local Bounce bounce;

}  // namespace

ssize_t DiskTier::Io::Pwrite(int fd, const void* buf, size_t n, off_t off) {
  return pwrite(fd, buf, n, off);
}
ssize_t DiskTier::Io::Pread(int fd, void* buf, size_t n, off_t off) {
  return pread(fd, buf, n, off);
}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Create(const std::string& dir,
                                                           const std::string& name,
                                                           size_t slot_bytes, int32_t slots,
                                                           std::shared_ptr<Io> io) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "--disk-cache-dir ", dir, ": ", std::strerror(errno), "; create it or choose another"));
  if (!S_ISDIR(st.st_mode))
    return absl::FailedPreconditionError(
        absl::StrCat("--disk-cache-dir ", dir, ": not a directory"));
  std::unique_ptr<DiskTier> t(new DiskTier());
  t->path_ = absl::StrCat(dir, "/", name);
  t->slot_bytes_ = slot_bytes;
  t->stride_ = TierStride(slot_bytes);
  t->slots_ = slots < 0 ? 0 : slots;
  t->io_ = io ? std::move(io) : std::make_shared<Io>();
  t->crc_.assign(t->slots_, 0);
  // A previous process's file: ours to remove, unless a live process still holds it.
  const int old = open(t->path_.c_str(), O_RDWR);
  if (old >= 0) {
    const bool held = flock(old, LOCK_EX | LOCK_NB) != 0;
    close(old);
    if (held)
      return absl::AlreadyExistsError(absl::StrCat(
          "disk tier ", t->path_, " is held by a live process; give each attnd its own name"));
    unlink(t->path_.c_str());
  }
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = open(t->path_.c_str(), flags | O_DIRECT, 0600);
  t->direct_ = fd >= 0;
  if (fd < 0) fd = open(t->path_.c_str(), flags, 0600);  // a filesystem without O_DIRECT
  if (fd < 0)
    return absl::FailedPreconditionError(absl::StrCat("--disk-cache-dir ", dir, ": cannot create ",
                                                      t->path_, ": ", std::strerror(errno)));
  t->fd_ = fd;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0)
    return absl::AlreadyExistsError(
        absl::StrCat("disk tier ", t->path_, " is held by another process"));
  return t;
}

DiskTier::~DiskTier() {
  if (fd_ < 0) return;
  unlink(path_.c_str());
  close(fd_);
}

absl::Status DiskTier::Write(int32_t slot, const uint8_t* data, size_t room) {
  const uint8_t* src = data;
  // O_DIRECT moves whole aligned blocks: bounce what is not aligned or not a whole block.
  if (direct_ && (reinterpret_cast<uintptr_t>(data) % kTierAlign != 0 ||
                  std::max(room, slot_bytes_) < stride_)) {
    uint8_t* b = bounce.Get(stride_);
    if (b == nullptr) return absl::ResourceExhaustedError("disk tier: no memory for a write");
    std::memcpy(b, data, slot_bytes_);
    std::memset(b + slot_bytes_, 0, stride_ - slot_bytes_);
    src = b;
  }
  const size_t n = direct_ ? stride_ : slot_bytes_;
  const off_t base = static_cast<off_t>(slot) * static_cast<off_t>(stride_);
  for (size_t done = 0; done < n;) {
    const ssize_t w = io_->Pwrite(fd_, src + done, n - done, base + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = w < 0 ? errno : EIO;
      if (e == ENOSPC || e == EDQUOT)
        return absl::ResourceExhaustedError(
            absl::StrCat("disk tier full: ", path_, ": ", std::strerror(e)));
      return absl::UnavailableError(
          absl::StrCat("disk tier write: ", path_, ": ", std::strerror(e)));
    }
    done += static_cast<size_t>(w);
  }
  crc_[slot] = Crc32c(data, slot_bytes_);
  written_ += static_cast<int64_t>(slot_bytes_);
  return absl::OkStatus();
}

absl::Status DiskTier::Read(int32_t slot, uint8_t* out, size_t room) {
  uint8_t* dst = out;
  const bool bounced = direct_ && (reinterpret_cast<uintptr_t>(out) % kTierAlign != 0 ||
                                   std::max(room, slot_bytes_) < stride_);
  if (bounced) {
    dst = bounce.Get(stride_);
    if (dst == nullptr) return absl::ResourceExhaustedError("disk tier: no memory for a read");
  }
  const size_t n = direct_ ? stride_ : slot_bytes_;
  const off_t base = static_cast<off_t>(slot) * static_cast<off_t>(stride_);
  for (size_t done = 0; done < n;) {
    const ssize_t r = io_->Pread(fd_, dst + done, n - done, base + static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return absl::DataLossError(absl::StrCat("disk tier read: ", path_, ": slot ", slot, ": ",
                                              r < 0 ? std::strerror(errno) : "short read"));
    done += static_cast<size_t>(r);
  }
  if (bounced) std::memcpy(out, dst, slot_bytes_);
  if (Crc32c(out, slot_bytes_) != crc_[slot])
    return absl::DataLossError(
        absl::StrCat("disk tier read: ", path_, ": slot ", slot, ": checksum mismatch"));
  read_ += static_cast<int64_t>(slot_bytes_);
  return absl::OkStatus();
}

}  // namespace attnd
