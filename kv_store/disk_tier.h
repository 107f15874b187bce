// The disk tier's bytes (kv_store/page_directory.h's Tier::kDisk): one page file under
// --disk-cache-dir, `slots` slots of a page's staged bytes each (4 KiB aligned), written and read
// with pwrite/pread (O_DIRECT where the filesystem takes it), a CRC-32C of each slot kept in
// memory and checked on every read. Scratch, not durability: the file starts empty at every
// start (a previous process's file of the same name is removed), is locked against a second live
// process, and is removed when the tier goes.
// Thread safety: distinct slots may be read and written concurrently.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace attnd {

class DiskTier {
 public:
  // The system calls the tier makes, replaceable by tests (disk full, read errors).
  struct Io {
    virtual ~Io() = default;
    virtual ssize_t Pwrite(int fd, const void* buf, size_t n, off_t off);
    virtual ssize_t Pread(int fd, void* buf, size_t n, off_t off);
  };

  // FAILED_PRECONDITION naming the directory when it is missing, not a directory, or a file cannot
  // be made in it; ALREADY_EXISTS when a live process holds the same file.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Create(const std::string& dir,
                                                          const std::string& name,
                                                          size_t slot_bytes, int32_t slots,
                                                          std::shared_ptr<Io> io = nullptr);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  int32_t slots() const { return slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t capacity_bytes() const { return static_cast<size_t>(slots_) * stride_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }  // opened with O_DIRECT

  // slot_bytes from `data` into `slot`. RESOURCE_EXHAUSTED when the disk is full (ENOSPC, EDQUOT),
  // UNAVAILABLE for another write error; the slot's old bytes are then not to be trusted.
  // `room`: bytes the caller's buffer holds (>= slot_bytes); a buffer aligned to kTierAlign with
  // room for a whole TierStride(slot_bytes) block goes to the disk as it is (O_DIRECT without a
  // bounce copy; the padding's bytes are not part of the page). Thread safe for distinct slots.
  absl::Status Write(int32_t slot, const uint8_t* data, size_t room = 0);
  // `slot` into `out` (slot_bytes; with `room` as for Write, the padding after them may be
  // overwritten). DATA_LOSS on a read error, a short read or a checksum mismatch.
  absl::Status Read(int32_t slot, uint8_t* out, size_t room = 0);
  // Bytes written and read so far (metrics).
  int64_t bytes_written() const { return written_.load(); }
  int64_t bytes_read() const { return read_.load(); }

 private:
  DiskTier() = default;
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  size_t slot_bytes_ = 0, stride_ = 0;
  int32_t slots_ = 0;
  std::shared_ptr<Io> io_;
  std::vector<uint32_t> crc_;  // [slots] of the bytes last written
  std::atomic<int64_t> written_{0}, read_{0};
};

}  // namespace attnd
