// The tiered KV store through the engine (docs/architecture.md#tiers): a server whose devices hold
// N sequences serves 4N, round robin, spilling to host and disk and restoring as steps need them,
// with every output bit for bit what a server holding all 4N on its devices gives (fp32, bf16
// and fp8 caches; forks and a migration among them); offload, prefetch and idle spills; a full
// disk refuses only the request that needed room and loses nothing; an unreadable page loses its
// sequences alone; everything comes back when every sequence is closed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv_store/disk_tier.h"
#include "kv_store/host_tier.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"
#include "tests/temp_dir.h"

namespace attnd::testing {
namespace {

namespace fs = std::filesystem;

// Disk system calls that fail on demand.
struct FaultyIo : DiskTier::Io {
  std::atomic<int> write_errno{0}, read_errno{0};
  ssize_t Pwrite(int fd, const void* buf, size_t n, off_t off) override {
    if (const int e = write_errno.load()) {
      errno = e;
      return -1;
    }
    return DiskTier::Io::Pwrite(fd, buf, n, off);
  }
  ssize_t Pread(int fd, void* buf, size_t n, off_t off) override {
    if (const int e = read_errno.load()) {
      errno = e;
      return -1;
    }
    return DiskTier::Io::Pread(fd, buf, n, off);
  }
};

// Two CPU devices of `usable` pages each (+ page 0), and tiers of `host` and `disk` pages.
EngineOptions Options(DType cache, int32_t usable, int32_t host, int32_t disk,
                      const std::string& dir, std::shared_ptr<DiskTier::Io> io = nullptr) {
  EngineOptions o = TestEngineOptions(MixedLayerSpec(SelectionMode::kToken), usable + 1, cache);
  o.devices = {"cpu:0", "cpu:1"};
  const size_t page = TierStride(CacheLayout::ForModel(o.spec, cache, usable + 1).BytesPerPage());
  o.tiers.host_bytes = page * host;
  if (disk > 0) {
    o.tiers.disk_dir = dir;
    o.tiers.disk_bytes = page * disk;
    o.tiers.disk_io = std::move(io);
  }
  return o;
}

DType RequestDType(DType cache) { return cache == DType::kF32 ? DType::kF32 : DType::kBF16; }

// The same operations on a small server (devices for N sequences, host and disk below) and a
// big one (devices for all): every output compared bit for bit.
struct Twins {
  Harness small, big;
  DType dtype;
  uint64_t seed = 1000;
  Twins(EngineOptions s, EngineOptions b, DType request)
      : small(std::move(s)), big(std::move(b)), dtype(request) {}
  void Open(const std::string& id, int device) {
    small.Open(id, device);
    big.Open(id, device);
  }
  void Fork(const std::string& id, const std::string& parent, int64_t n) {
    small.Fork(id, parent, n);
    big.Fork(id, parent, n);
  }
  void Step(const std::vector<StepEntry>& batch) {
    const auto in = small.MakeInputs(batch, dtype, ++seed);
    auto a = small.Run(batch, in);
    auto b = big.Run(batch, in);
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    const absl::Status invariants = small.engine().CheckInvariants();
    ASSERT_TRUE(invariants.ok()) << invariants;
    for (size_t l = 0; l < a.out.size(); ++l) {
      ASSERT_EQ(a.out[l], b.out[l]) << "layer " << l << ": the bits changed with the tiers";
      ASSERT_EQ(a.lse[l], b.lse[l]) << "layer " << l;
      ASSERT_EQ(a.traces[l].keys, b.traces[l].keys) << "layer " << l;
    }
  }
};

class TiersRoundRobin : public ::testing::TestWithParam<DType> {};

TEST_P(TiersRoundRobin, FourTimesWhatTheDevicesHoldDecodeBitForBitAsIfAllFit) {
  const DType cache = GetParam();
  TempDir dir("attnd-tiers");
  // 2 devices x 4 usable pages: 4 sequences of 2 pages; host 8 pages (4 sequences); disk below.
  Twins t(Options(cache, 4, 8, 48, dir.path), Options(cache, 64, 0, 0, ""), RequestDType(cache));
  std::vector<std::string> ids;
  for (int i = 0; i < 16; ++i) {
    ids.push_back(absl::StrCat("s", i));
    t.Open(ids.back(), i % 2);
  }
  for (const std::string& id : ids) t.Step({{id, 20}});  // prefill: 2 pages each
  t.Fork("f0", "s0", 13);                                // the partial page copied
  t.Fork("f1", "s5", 16);                                // a full page shared
  ids.push_back("f0");
  ids.push_back("f1");
  for (int round = 0; round < 5; ++round) {
    if (round == 2) {  // a migration between the devices, spilled or not
      ASSERT_TRUE(t.small.engine().MigrateSequence("s3", 0).ok());
      ASSERT_TRUE(t.big.engine().MigrateSequence("s3", 0).ok());
    }
    for (size_t i = 0; i < ids.size(); i += 2) t.Step({{ids[i], 1}, {ids[i + 1], 1}});
  }
  const EngineCounters c = t.small.engine().Counters();
  auto bytes = [&](Tier a, Tier b) {
    return c.tier_bytes[static_cast<int>(a)][static_cast<int>(b)];
  };
  EXPECT_GT(bytes(Tier::kDevice, Tier::kHost), 0) << "the host tier was not used";
  EXPECT_GT(bytes(Tier::kHost, Tier::kDisk) + bytes(Tier::kDevice, Tier::kDisk), 0)
      << "the disk tier was not used";
  EXPECT_GT(bytes(Tier::kDisk, Tier::kDevice), 0) << "nothing came back from disk";
  EXPECT_GT(c.spills, 16);
  EXPECT_GT(c.restores_step, 16);
  EXPECT_EQ(c.data_loss, 0);
  // Everything comes back: every sequence closed, every tier empty.
  for (const std::string& id : ids) ASSERT_TRUE(t.small.engine().CloseSequence(id).ok()) << id;
  for (const DeviceCapacity& d : t.small.engine().Capacity())
    EXPECT_EQ(d.pages_free, d.pages_total);
  for (const TierCapacity& tc : t.small.engine().Tiers()) EXPECT_EQ(tc.pages_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Caches, TiersRoundRobin,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kFP8E4M3),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Found by the engine-ops fuzzer: a batch refused for what it is (an unknown sequence, too many
// tokens) after a spilled sequence used to restore that one first.
TEST(Tiers, ABatchRefusedForWhatItIsMovesNothing) {
  TempDir dir("attnd-tiers");
  EngineOptions o = Options(DType::kF32, 16, 8, 16, dir.path);
  o.limits.max_step_tokens = 24;
  Harness h(std::move(o));
  h.Open("a", 0);
  h.Open("b", 0);
  h.RunAndCheck({{"a", 20}}, DType::kF32, 3, 1e-5);
  Engine& e = h.engine();
  ASSERT_TRUE(e.OffloadSequences({"a"}).ok());
  const int32_t free = e.Capacity()[0].pages_free;
  EXPECT_EQ(e.BeginStep({{"a", 1}, {"nobody", 1}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e.BeginStep({{"a", 10}, {"b", 20}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.BeginStep({{"a", 1}, {"a", 1}}).status().code(), absl::StatusCode::kInvalidArgument);
  // Found by the fuzzer too: an offload naming an unknown id moved the ones before it.
  EXPECT_EQ(e.OffloadSequences({"b", "nobody"}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e.DescribeSequence("b")->tier, Tier::kDevice);
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kHost);
  EXPECT_EQ(e.Capacity()[0].pages_free, free);
  EXPECT_EQ(e.Counters().restores_step, 0);
  h.RunAndCheck({{"a", 1}, {"b", 2}}, DType::kF32, 4, 1e-5);  // a good one restores it
  EXPECT_EQ(e.Counters().restores_step, 1);
}

// A client that floods PrefetchSequences with unknown ids and the same id again and again queues
// at most one restore per spilled sequence (the queue never outgrows the table).
TEST(Tiers, PrefetchFloodsQueueEachSpilledSequenceOnce) {
  TempDir dir("attnd-tiers");
  Harness h(Options(DType::kF32, 16, 8, 16, dir.path));
  h.Open("a", 0);
  h.RunAndCheck({{"a", 20}}, DType::kF32, 3, 1e-5);
  Engine& e = h.engine();
  ASSERT_TRUE(e.OffloadSequences({"a"}).ok());
  std::vector<SequenceKey> flood;
  for (int i = 0; i < 20000; ++i)
    flood.push_back(i % 2 ? SequenceKey("a") : SequenceKey(absl::StrCat("x", i)));
  for (int round = 0; round < 10; ++round) e.PrefetchSequences(flood);
  e.WaitForPrefetches();
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kDevice);
  EXPECT_EQ(e.Counters().restores_prefetch, 1);
  e.PrefetchSequences(flood);  // on its device now: nothing queued, nothing moves
  e.WaitForPrefetches();
  EXPECT_EQ(e.Counters().restores_prefetch, 1);
  h.RunAndCheck({{"a", 1}}, DType::kF32, 4, 1e-5);
}

TEST(Tiers, OffloadPrefetchAndIdleSpillsMoveSequencesAndStepsBringThemBack) {
  TempDir dir("attnd-tiers");
  Twins t(Options(DType::kF32, 16, 8, 16, dir.path), Options(DType::kF32, 64, 0, 0, ""),
          DType::kF32);
  for (const char* id : {"a", "b", "c"}) {
    t.Open(id, 0);
    t.Step({{id, 20}});
  }
  Engine& e = t.small.engine();
  ASSERT_TRUE(e.OffloadSequences({"a"}).ok());
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kHost);
  EXPECT_TRUE(e.DescribeSequence("a")->pages.empty());
  e.PrefetchSequences({"a"});
  // A sequence names its destination tier from the move's start (SequenceInfo::moving says it
  // is still on its way); the counters and the spill below need the move ended.
  e.WaitForPrefetches();
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kDevice);
  EXPECT_FALSE(e.DescribeSequence("a")->moving);
  EXPECT_EQ(e.Counters().restores_prefetch, 1);
  EXPECT_EQ(e.SpillIdleSequences(std::chrono::milliseconds(0)), 3);
  for (const char* id : {"a", "b", "c"}) EXPECT_NE(e.DescribeSequence(id)->tier, Tier::kDevice);
  t.Step({{"a", 1}, {"c", 1}});  // restored by the step
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kDevice);
  EXPECT_NE(e.DescribeSequence("b")->tier, Tier::kDevice);
  EXPECT_EQ(e.Counters().restores_step, 2);
  // No tier below: offload says so.
  Harness plain(Options(DType::kF32, 16, 0, 0, ""));
  plain.Open("x");
  EXPECT_EQ(plain.engine().OffloadSequences({"x"}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(plain.engine().SpillIdleSequences(std::chrono::milliseconds(0)), 0);
}

// Rows [begin, end) of every layer as an export reads them (Engine::ReadRows), each layer's
// parts joined.
std::vector<std::string> ExportRows(Engine& e, const std::string& id, int64_t begin, int64_t end) {
  std::vector<std::string> out;
  for (int layer = 0; layer < e.spec().num_layers(); ++layer) {
    auto r = e.ReadRows(id, layer, begin, end);
    EXPECT_TRUE(r.ok()) << id << " layer " << layer << ": " << r.status();
    if (!r.ok()) return out;
    out.push_back(absl::StrCat(r->kv_latent, "|", r->kv_latent_scales, "|", r->k_rope, "|",
                               r->index_k, "|", r->index_k_scales));
  }
  return out;
}

class TiersExport : public ::testing::TestWithParam<DType> {};

// An export, a drain or a standby's copy reads a spilled sequence where it is: the bytes it
// had on the device, with no restore to the device and nothing spilled there for room; pages it
// shares with a sequence on the device are read there. A sequence on the disk comes up to the
// host (its pages read once, not once per layer), or to its device without a host tier.
TEST_P(TiersExport, ASpilledSequenceIsReadWhereItIsBitForBit) {
  const DType cache = GetParam();
  const DType request = RequestDType(cache);
  TempDir dir("attnd-tiers");
  Harness h(Options(cache, 16, 4, 16, dir.path));
  Engine& e = h.engine();
  const int64_t ps = e.spec().page_size;
  h.Open("a", 0);
  h.Open("b", 0);
  ASSERT_TRUE(h.Run({{"a", ps + 5}, {"b", 2 * ps}},
                    h.MakeInputs({{"a", ps + 5}, {"b", 2 * ps}}, request, 5))
                  .status.ok());
  h.Fork("c", "a", ps + 3, 0);  // shares a's first page, copies the partial one
  ASSERT_TRUE(h.Run({{"c", 4}}, h.MakeInputs({{"c", 4}}, request, 6)).status.ok());
  std::map<std::string, std::vector<std::string>> whole, part;
  for (const char* id : {"a", "b", "c"}) {
    whole[id] = ExportRows(e, id, 0, e.DescribeSequence(id)->length);
    part[id] = ExportRows(e, id, 3, ps + 2);  // across a page boundary, from mid-page
  }
  ASSERT_TRUE(e.OffloadSequences({"b", "c"}).ok());  // the host holds 4 pages: b's 2, c's own 1
  EXPECT_EQ(e.DescribeSequence("b")->tier, Tier::kHost);
  EXPECT_EQ(e.DescribeSequence("c")->tier, Tier::kHost);
  const int32_t free = e.Capacity()[0].pages_free;
  const EngineCounters before = e.Counters();
  for (const char* id : {"b", "c"}) {
    EXPECT_EQ(ExportRows(e, id, 0, e.DescribeSequence(id)->length), whole[id]) << id;
    EXPECT_EQ(ExportRows(e, id, 3, ps + 2), part[id]) << id;
    EXPECT_EQ(e.DescribeSequence(id)->tier, Tier::kHost) << id;
  }
  EXPECT_EQ(e.Capacity()[0].pages_free, free);
  EXPECT_EQ(e.Counters().restores_other, before.restores_other);
  EXPECT_EQ(e.Counters().spills, before.spills);
  ASSERT_TRUE(e.CheckInvariants().ok());
  // a to the host makes room there by sending the least recently used (b) to the disk; reading b
  // brings it back up to the host (sending the least recently used down for room), never to the
  // device; so does reading a or c when a page of theirs went down.
  ASSERT_TRUE(e.OffloadSequences({"a"}).ok());
  ASSERT_EQ(e.DescribeSequence("b")->tier, Tier::kDisk);
  const int32_t free_a = e.Capacity()[0].pages_free;
  EXPECT_EQ(ExportRows(e, "b", 0, 2 * ps), whole["b"]);
  EXPECT_EQ(e.DescribeSequence("b")->tier, Tier::kHost);
  EXPECT_EQ(e.Capacity()[0].pages_free, free_a);
  EXPECT_EQ(e.Counters().restores_other, before.restores_other + 1);
  for (const char* id : {"a", "c"}) EXPECT_EQ(ExportRows(e, id, 3, ps + 2), part[id]) << id;
  ASSERT_TRUE(e.CheckInvariants().ok());
  // The sequences decode on where they are, as the float64 reference says.
  h.RunAndCheck({{"a", 1}, {"b", 1}, {"c", 2}}, request, 7, cache == DType::kF32 ? 1e-5 : 1e-2);
  // Without a host tier a sequence on the disk comes up to its device to be read.
  TempDir dir2("attnd-tiers");
  Harness d(Options(cache, 16, 0, 16, dir2.path));
  d.Open("x", 1);
  ASSERT_TRUE(d.Run({{"x", ps + 7}}, d.MakeInputs({{"x", ps + 7}}, request, 8)).status.ok());
  const std::vector<std::string> x = ExportRows(d.engine(), "x", 0, ps + 7);
  ASSERT_TRUE(d.engine().OffloadSequences({"x"}).ok());
  ASSERT_EQ(d.engine().DescribeSequence("x")->tier, Tier::kDisk);
  EXPECT_EQ(ExportRows(d.engine(), "x", 0, ps + 7), x);
  EXPECT_EQ(d.engine().DescribeSequence("x")->tier, Tier::kDevice);
}

// A page of a sequence on the disk that cannot be read back loses that sequence: the export
// says DATA_LOSS, naming the sequence, not the server's file.
TEST(Tiers, AnExportOfASequenceWhosePageIsUnreadableIsDataLoss) {
  TempDir dir("attnd-tiers");
  auto io = std::make_shared<FaultyIo>();
  Harness h(Options(DType::kF32, 16, 2, 16, dir.path, io));
  h.Open("a", 0);
  h.Open("b", 0);
  h.RunAndCheck({{"a", 20}, {"b", 20}}, DType::kF32, 3, 1e-5);
  Engine& e = h.engine();
  ASSERT_TRUE(e.OffloadSequences({"a", "b"}).ok());  // a on to the disk, b on the host
  ASSERT_EQ(e.DescribeSequence("a")->tier, Tier::kDisk);
  io->read_errno = EIO;
  const auto r = e.ReadRows("a", 0, 0, 20);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("'a'"), std::string::npos) << r.status();
  EXPECT_EQ(r.status().message().find(dir.path), std::string::npos) << r.status();
  io->read_errno = 0;
  EXPECT_TRUE(e.DescribeSequence("a")->lost);
  EXPECT_EQ(e.ReadRows("a", 1, 0, 20).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(e.ReadRows("b", 1, 0, 20).ok());  // the other reads on
  ASSERT_TRUE(e.CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(Caches, TiersExport,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kFP8E4M3),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(Tiers, AFullDiskRefusesTheRequestThatNeededRoomAndLosesNothing) {
  TempDir dir("attnd-tiers");
  auto io = std::make_shared<FaultyIo>();
  // No host tier: every spill goes to disk.
  Twins t(Options(DType::kF32, 4, 0, 16, dir.path, io), Options(DType::kF32, 64, 0, 0, ""),
          DType::kF32);
  for (const char* id : {"a", "b", "c"}) t.Open(id, 0);
  t.Step({{"a", 20}});
  t.Step({{"b", 20}});  // device 0 full now
  io->write_errno = ENOSPC;
  const auto in = t.small.MakeInputs({{"c", 20}}, DType::kF32, 7);
  auto refused = t.small.Run({{"c", 20}}, in);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("disk tier full"), std::string::npos) << refused.status;
  for (const char* id : {"a", "b"})
    EXPECT_EQ(t.small.engine().DescribeSequence(id)->tier, Tier::kDevice);
  EXPECT_EQ(t.small.engine().Tiers()[1].pages_used, 0);  // reservations given back
  io->write_errno = 0;
  t.Step({{"c", 20}});  // now it spills a and fits; and a, b come back bit for bit
  t.Step({{"a", 1}, {"b", 1}});
  t.Step({{"c", 1}});
}

TEST(Tiers, AnUnreadablePageLosesItsSequencesAloneAndIsDataLossOnTheirNextUse) {
  TempDir dir("attnd-tiers");
  auto io = std::make_shared<FaultyIo>();
  std::vector<TierEvent> events;
  std::mutex events_mu;
  EngineOptions small = Options(DType::kF32, 8, 0, 32, dir.path, io);
  small.on_tier_event = [&](const TierEvent& e) {
    std::lock_guard<std::mutex> lock(events_mu);
    events.push_back(e);
  };
  Twins t(std::move(small), Options(DType::kF32, 64, 0, 0, ""), DType::kF32);
  for (const char* id : {"a", "b", "c"}) {
    t.Open(id, 0);
    t.Step({{id, 20}});
  }
  Engine& e = t.small.engine();
  ASSERT_TRUE(e.OffloadSequences({"a", "b"}).ok());
  EXPECT_EQ(e.DescribeSequence("a")->tier, Tier::kDisk);
  io->read_errno = EIO;
  const auto in = t.small.MakeInputs({{"a", 1}}, DType::kF32, 9);
  auto lost = t.small.Run({{"a", 1}}, in);
  EXPECT_EQ(lost.status.code(), absl::StatusCode::kDataLoss) << lost.status;
  io->read_errno = 0;
  EXPECT_TRUE(e.DescribeSequence("a")->lost);
  EXPECT_EQ(e.Counters().data_loss, 1);
  // Its next use says so too; b and c are untouched.
  EXPECT_EQ(t.small.Run({{"a", 1}}, in).status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(e.ForkSequence("x", "a", 1).code(), absl::StatusCode::kDataLoss);
  t.Step({{"b", 1}, {"c", 1}});
  ASSERT_TRUE(e.CloseSequence("a").ok());
  bool logged = false;
  for (const TierEvent& ev : events)
    logged = logged || (ev.kind == TierEvent::Kind::kDataLoss && ev.sequence == "a");
  EXPECT_TRUE(logged);
  // Pages: a's are gone; b back on the device, c there; the disk empty once b came up.
  EXPECT_EQ(e.Tiers()[1].pages_used, 0);
}

TEST(Tiers, ACorruptedPageIsDetectedByItsChecksum) {
  TempDir dir("attnd-tiers");
  EngineOptions o = Options(DType::kF32, 8, 0, 16, dir.path);
  std::string detail;
  std::mutex detail_mu;
  o.on_tier_event = [&](const TierEvent& ev) {
    std::lock_guard<std::mutex> lock(detail_mu);
    if (ev.kind == TierEvent::Kind::kDataLoss) detail = ev.detail;
  };
  Harness h(std::move(o));
  h.Open("a", 0);
  h.RunAndCheck({{"a", 20}}, DType::kF32, 3, 1e-5);
  Engine& e = h.engine();
  ASSERT_TRUE(e.OffloadSequences({"a"}).ok());
  const std::string file = e.Tiers()[1].where;
  {
    FILE* f = fopen(file.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(fseek(f, 100, SEEK_SET), 0);
    const int c = fgetc(f);
    ASSERT_EQ(fseek(f, 100, SEEK_SET), 0);
    fputc(c ^ 0x10, f);
    fclose(f);
  }
  auto step = e.BeginStep({{"a", 1}});
  EXPECT_EQ(step.status().code(), absl::StatusCode::kDataLoss) << step.status();
  // The client hears which sequence was lost; the file, slot and cause go to the server's log.
  EXPECT_NE(step.status().message().find("'a' lost its cached pages"), std::string::npos)
      << step.status();
  EXPECT_EQ(step.status().message().find(file), std::string::npos) << step.status();
  std::lock_guard<std::mutex> lock(detail_mu);
  EXPECT_NE(detail.find("checksum mismatch"), std::string::npos) << detail;
  EXPECT_NE(detail.find(file), std::string::npos) << detail;
}

TEST(Tiers, AMissingDiskDirectoryIsAClearStartupError) {
  EngineOptions o = Options(DType::kF32, 8, 0, 16, "/nonexistent/attnd-disk");
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("--disk-cache-dir"), std::string::npos) << e.status();
}

// Steps, aborts, offloads, prefetches and closes from several threads over tiers that thrash:
// nothing is lost or freed twice, and every page and slot comes back at the end.
TEST(Tiers, ConcurrentStepsAbortsAndMovesLeaveNothingBehind) {
  TempDir dir("attnd-tiers");
  Harness h(Options(DType::kF32, 6, 6, 24, dir.path));
  Engine& e = h.engine();
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) {
    ids.push_back(absl::StrCat("c", i));
    ASSERT_TRUE(e.OpenSequence(ids.back(), i % 2).ok());
  }
  const auto in = RandomLayers(e.spec(), 3, DType::kF32, 5);
  std::atomic<int> ok_steps{0}, workers_done{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      std::mt19937 rng(w);
      for (int k = 0; k < 40; ++k) {
        const std::string& id = ids[(w * 2 + rng() % 2) % ids.size()];
        const int op = rng() % 5;
        if (op == 0) {
          (void)e.OffloadSequences({id});
          continue;
        }
        if (op == 1) {
          e.PrefetchSequences({id});
          continue;
        }
        auto step = e.BeginStep({{id, 3}});
        if (!step.ok()) continue;
        if (op == 2) {  // aborted midway
          (void)e.AbortStep(*step);
          continue;
        }
        bool good = true;
        for (int l = 0; l < e.spec().num_layers() && good; ++l) {
          std::vector<uint8_t> out(3 * e.spec().num_heads * e.spec().kv_lora_rank * 4);
          good = RunLayerInto(e, *step, l, in[l].inputs(), out.data(), out.size()).ok();
        }
        ok_steps += good;
      }
      ++workers_done;
    });
  // An exporter reading them wherever they are while the workers run (pins on the host, lifts
  // from disk), then each once more (so some read has rows whatever the timing).
  std::atomic<int> reads{0};
  threads.emplace_back([&] {
    std::mt19937 rng(99);
    auto read = [&](const std::string& id) {
      const auto info = e.DescribeSequence(id);
      if (!info.ok() || info->length == 0) return;
      const auto rows =
          e.ReadRows(id, static_cast<int>(rng() % e.spec().num_layers()), 0, info->length);
      const absl::StatusCode code = rows.status().code();
      EXPECT_TRUE(rows.ok() || code == absl::StatusCode::kResourceExhausted ||
                  code == absl::StatusCode::kDeadlineExceeded)
          << rows.status();
      reads += rows.ok();
    };
    while (workers_done.load() < 4) {
      read(ids[rng() % ids.size()]);
      std::this_thread::yield();
    }
    for (const std::string& id : ids) read(id);
  });
  for (auto& th : threads) th.join();
  EXPECT_GT(ok_steps.load(), 20);
  EXPECT_GT(reads.load(), 0);
  for (const std::string& id : ids) ASSERT_TRUE(e.CloseSequence(id).ok()) << id;
  EXPECT_EQ(e.num_open_steps(), 0);
  for (const DeviceCapacity& d : e.Capacity()) EXPECT_EQ(d.pages_free, d.pages_total);
  for (const TierCapacity& tc : e.Tiers()) EXPECT_EQ(tc.pages_used, 0);
  for (int d = 0; d < 2; ++d) {
    const auto refs = e.PageRefcounts(d);
    for (size_t p = 1; p < refs.size(); ++p) EXPECT_EQ(refs[p], 0) << d << ":" << p;
  }
}

}  // namespace
}  // namespace attnd::testing
