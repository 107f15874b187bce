// The tiers' storage (kv_store/host_tier.h, disk_tier.h, slot_pool.h) and the disk tier's
// checksum (common/crc32c.h): bytes round-trip, a corrupted or unreadable slot is DATA_LOSS, a
// full disk is RESOURCE_EXHAUSTED, a missing or unusable directory is a clear startup error, the
// page file starts empty, is locked against a second process and is removed at the end.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "kv_store/disk_tier.h"
#include "kv_store/host_tier.h"
#include "kv_store/slot_pool.h"
#include "tests/temp_dir.h"

namespace attnd {
namespace {

namespace fs = std::filesystem;
using ::attnd::testing::TempDir;

std::vector<uint8_t> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Crc32c, KnownValuesAndBothImplementationsAgree) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);  // the standard check value
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  const std::vector<uint8_t> v = Random(100003, 1);
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{4096}, v.size()})
    EXPECT_EQ(Crc32c(v.data(), n), Crc32cPortable(v.data(), n)) << n;
  // Continuing a CRC over pieces equals one pass.
  EXPECT_EQ(Crc32c(v.data() + 100, 900, Crc32c(v.data(), 100)), Crc32c(v.data(), 1000));
}

TEST(SlotPool, AllocatesLowestFirstAndAllOrNothing) {
  SlotPool p(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(p.Allocate(3, &got));
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(p.Allocate(2, &got));  // one free: nothing taken
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(p.free_slots(), 1);
  p.Free(1);
  EXPECT_FALSE(p.used(1));
  EXPECT_EQ(p.free_slots(), 2);
  EXPECT_DEATH(p.Free(1), "not a slot in use");
}

TEST(HostTier, SlotsAreDistinctAlignedAndHoldTheirBytes) {
  auto t = HostTier::Create(10000, 3, AnonymousHostMemory());
  ASSERT_TRUE(t.ok()) << t.status();
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>((*t)->Slot(s)) % kTierAlign, 0u);
    const auto v = Random(10000, s);
    std::memcpy((*t)->Slot(s), v.data(), v.size());
  }
  for (int s = 0; s < 3; ++s)
    EXPECT_EQ(std::memcmp((*t)->Slot(s), Random(10000, s).data(), 10000), 0);
  EXPECT_EQ((*t)->capacity_bytes(), 30000u);
  auto none = HostTier::Create(10000, 0, AnonymousHostMemory());
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->slots(), 0);
}

TEST(DiskTier, PagesRoundTripAndEachSlotIsChecked) {
  TempDir dir("attnd-tier");
  for (size_t bytes : {size_t{5000}, size_t{8192}}) {  // a partial last block, and whole blocks
    auto d = DiskTier::Create(dir.path, "pages.bin", bytes, 4);
    ASSERT_TRUE(d.ok()) << d.status();
    std::vector<std::vector<uint8_t>> want;
    for (int s = 0; s < 4; ++s) {
      want.push_back(Random(bytes, 10 + s));
      // Unaligned sources too: the tier bounces them for O_DIRECT.
      std::vector<uint8_t> buf(bytes + 1);
      std::memcpy(buf.data() + 1, want.back().data(), bytes);
      ASSERT_TRUE((*d)->Write(s, buf.data() + 1).ok());
    }
    for (int s = 3; s >= 0; --s) {
      std::vector<uint8_t> got(bytes + 3);
      ASSERT_TRUE((*d)->Read(s, got.data() + 3).ok());
      EXPECT_EQ(std::memcmp(got.data() + 3, want[s].data(), bytes), 0) << s;
    }
    EXPECT_EQ((*d)->bytes_written(), static_cast<int64_t>(4 * bytes));
    EXPECT_EQ((*d)->bytes_read(), static_cast<int64_t>(4 * bytes));
  }
}

// Aligned buffers with room for a whole block (the engine's staging and host slots) go to and
// from the disk as they are: the padding's bytes are not part of the page, and the checksum
// still covers every byte that is.
TEST(DiskTier, AlignedBuffersWithRoomForAWholeBlockRoundTripFromFourThreads) {
  TempDir dir("attnd-tier");
  const size_t bytes = 5000, room = TierStride(bytes);
  auto d = DiskTier::Create(dir.path, "pages.bin", bytes, 8);
  ASSERT_TRUE(d.ok()) << d.status();
  struct Aligned {
    uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(kTierAlign, 8192));
    ~Aligned() { std::free(p); }
  };
  std::vector<Aligned> bufs(8);
  std::vector<std::vector<uint8_t>> want;
  for (int s = 0; s < 8; ++s) {
    want.push_back(Random(bytes, 40 + s));
    std::memcpy(bufs[s].p, want.back().data(), bytes);
    std::memset(bufs[s].p + bytes, 0x77 + s, room - bytes);  // padding: not the page's
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> wrote(8), read(8);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int s = t; s < 8; s += 4) wrote[s] = (*d)->Write(s, bufs[s].p, room);
    });
  for (std::thread& t : threads) t.join();
  threads.clear();
  for (int s = 0; s < 8; ++s) {
    ASSERT_TRUE(wrote[s].ok()) << wrote[s];
    std::memset(bufs[s].p, 0, 8192);
  }
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int s = t; s < 8; s += 4) read[s] = (*d)->Read(s, bufs[s].p, room);
    });
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < 8; ++s) {
    ASSERT_TRUE(read[s].ok()) << read[s];
    EXPECT_EQ(std::memcmp(bufs[s].p, want[s].data(), bytes), 0) << s;
  }
  EXPECT_EQ((*d)->bytes_written(), static_cast<int64_t>(8 * bytes));
}

TEST(DiskTier, ACorruptedSlotIsDataLossAndTheOthersStillRead) {
  TempDir dir("attnd-tier");
  const size_t bytes = 6000;
  auto d = DiskTier::Create(dir.path, "pages.bin", bytes, 3);
  ASSERT_TRUE(d.ok());
  for (int s = 0; s < 3; ++s) ASSERT_TRUE((*d)->Write(s, Random(bytes, s).data()).ok());
  {  // flip one byte of slot 1 behind the tier's back
    const int fd = open((*d)->path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t at = static_cast<off_t>(TierStride(bytes)) + 1234;
    uint8_t b = 0;
    ASSERT_EQ(pread(fd, &b, 1, at), 1);
    b ^= 0x40;
    ASSERT_EQ(pwrite(fd, &b, 1, at), 1);
    close(fd);
  }
  std::vector<uint8_t> got(bytes);
  const absl::Status s1 = (*d)->Read(1, got.data());
  EXPECT_EQ(s1.code(), absl::StatusCode::kDataLoss) << s1;
  EXPECT_NE(s1.message().find("checksum"), std::string::npos);
  for (int s : {0, 2}) {
    ASSERT_TRUE((*d)->Read(s, got.data()).ok()) << s;
    EXPECT_EQ(got, Random(bytes, s));
  }
}

// System calls that fail on demand: ENOSPC for writes, EIO for reads.
struct FaultyIo : DiskTier::Io {
  std::atomic<int> write_errno{0}, read_errno{0};
  ssize_t Pwrite(int fd, const void* buf, size_t n, off_t off) override {
    if (write_errno) {
      errno = write_errno;
      return -1;
    }
    return DiskTier::Io::Pwrite(fd, buf, n, off);
  }
  ssize_t Pread(int fd, void* buf, size_t n, off_t off) override {
    if (read_errno) {
      errno = read_errno;
      return -1;
    }
    return DiskTier::Io::Pread(fd, buf, n, off);
  }
};

TEST(DiskTier, AFullDiskIsResourceExhaustedAndAReadErrorIsDataLoss) {
  TempDir dir("attnd-tier");
  auto io = std::make_shared<FaultyIo>();
  auto d = DiskTier::Create(dir.path, "pages.bin", 4096, 2, io);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->Write(0, Random(4096, 1).data()).ok());
  io->write_errno = ENOSPC;
  const absl::Status full = (*d)->Write(1, Random(4096, 2).data());
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("disk tier full"), std::string::npos);
  io->write_errno = EIO;
  EXPECT_EQ((*d)->Write(1, Random(4096, 2).data()).code(), absl::StatusCode::kUnavailable);
  io->write_errno = 0;
  io->read_errno = EIO;
  std::vector<uint8_t> got(4096);
  EXPECT_EQ((*d)->Read(0, got.data()).code(), absl::StatusCode::kDataLoss);
  io->read_errno = 0;
  ASSERT_TRUE((*d)->Read(0, got.data()).ok());  // slot 0 was never harmed
  EXPECT_EQ(got, Random(4096, 1));
}

TEST(DiskTier, AMissingOrUnusableDirectoryIsAClearStartupError) {
  TempDir dir("attnd-tier");
  auto missing = DiskTier::Create(dir.path + "/nope", "p.bin", 4096, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("--disk-cache-dir"), std::string::npos);
  const std::string file = dir.path + "/plain";
  std::ofstream(file) << "x";
  auto not_dir = DiskTier::Create(file, "p.bin", 4096, 1);
  EXPECT_EQ(not_dir.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(not_dir.status().message().find("not a directory"), std::string::npos);
}

TEST(DiskTier, StartsEmptyIsLockedAgainstASecondProcessAndIsRemovedAtTheEnd) {
  TempDir dir("attnd-tier");
  const std::string path = dir.path + "/pages.bin";
  std::ofstream(path) << std::string(100000, 'z');  // a previous process's file
  {
    auto d = DiskTier::Create(dir.path, "pages.bin", 4096, 8);
    ASSERT_TRUE(d.ok()) << d.status();
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 0);  // the old bytes are gone
    auto again = DiskTier::Create(dir.path, "pages.bin", 4096, 8);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
    EXPECT_TRUE(fs::exists(path));  // the holder's file was left alone
  }
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace attnd
