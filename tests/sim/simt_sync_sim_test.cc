// The simulation's ordering (tests/sim/simt_sim.h): named barriers and mbarriers order the
// threads that take part and no others; a producer and a consumer handing stages through an
// mbarrier ring are race-free exactly when every wait and arrive is where it must be; a cp.async
// is ordered from its issue; a wgmma's operand reads are ordered before a later write only
// through every thread of its warpgroup. Each mistake is refused by its own error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "tests/sim/simt_sim.h"

namespace attnd::cuda {
namespace {

// Runs body on a block; the error it ends with ("" when none).
std::string RunBlock(sim::SimtMemory& mem, int threads, size_t smem,
                     const std::function<void(sim::SimtThread&)>& body) {
  sim::SimtBlock b(mem, threads, smem);
  try {
    b.Run([&](sim::SimtThread& t) { body(t); });
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// Warp 0 consumes what warp 1 produces, through two stages of 32 words and full / empty
// mbarriers, for six rounds; each consumer lane sums its neighbour's words.
enum class Ring {
  kRight,
  kSkipFullWait,       // the consumer reads round 1 without waiting for it
  kArriveBeforeWrite,  // the producer arrives on full, then writes
  kArriveBeforeRead,   // the consumer arrives on empty, then reads
  kSkipEmptyWait,      // the producer overwrites a stage without waiting for it
};
constexpr int kRounds = 6;
constexpr uint32_t kFull = 256, kEmpty = 272;  // two mbarriers each, after the stages

float Word(int round, int lane) { return static_cast<float>(round * 37 + lane * 3 + 1) / 7.0f; }

std::string RunRing(Ring mode, std::vector<float>& out) {
  out.assign(32, NAN);
  sim::SimtMemory mem;
  mem.Output(out.data(), out.size() * 4, "out");
  return RunBlock(mem, 64, 512, [&](sim::SimtThread& t) {
    const int l = t.lane();
    if (t.tid() == 0)
      for (uint32_t s = 0; s < 2; ++s)
        t.MbarInit(kFull + 8 * s, 32), t.MbarInit(kEmpty + 8 * s, 32);
    t.Sync();
    if (t.warp() == 1) {
      for (int r = 0; r < kRounds; ++r) {
        const uint32_t s = r % 2;
        if (r >= 2 && mode != Ring::kSkipEmptyWait) t.MbarWait(kEmpty + 8 * s, (r / 2 - 1) & 1);
        if (mode == Ring::kArriveBeforeWrite) t.MbarArrive(kFull + 8 * s);
        t.St(s * 128 + 4 * l, Word(r, l));
        if (mode != Ring::kArriveBeforeWrite) t.MbarArrive(kFull + 8 * s);
      }
      return;
    }
    float sum = 0;
    for (int r = 0; r < kRounds; ++r) {
      const uint32_t s = r % 2;
      if (!(mode == Ring::kSkipFullWait && r == 1)) t.MbarWait(kFull + 8 * s, (r / 2) & 1);
      if (mode == Ring::kArriveBeforeRead) t.MbarArrive(kEmpty + 8 * s);
      sum += t.Ld<float>(s * 128 + 4 * ((l + 1) % 32));
      if (mode != Ring::kArriveBeforeRead) t.MbarArrive(kEmpty + 8 * s);
    }
    t.Gst(out.data() + l, sum);
  });
}

TEST(SimtSyncSim, AnMbarrierRingOrdersAProducerAndAConsumer) {
  std::vector<float> out;
  ASSERT_EQ(RunRing(Ring::kRight, out), "");
  for (int l = 0; l < 32; ++l) {
    float want = 0;
    for (int r = 0; r < kRounds; ++r) want += Word(r, (l + 1) % 32);
    EXPECT_EQ(out[l], want) << l;
  }
  EXPECT_NE(RunRing(Ring::kSkipFullWait, out).find("wrote with no barrier between"),
            std::string::npos);
  EXPECT_NE(RunRing(Ring::kArriveBeforeWrite, out).find("wrote with no barrier between"),
            std::string::npos);
  EXPECT_NE(RunRing(Ring::kArriveBeforeRead, out).find("write of a byte another thread read"),
            std::string::npos);
  // The fibers run to their next wait in turn, so a producer that skips the empty wait runs all
  // six rounds ahead of every read: the consumer's wait for round 1 then passes on the third
  // phase of full[1], and the parity check names it.
  const std::string e = RunRing(Ring::kSkipEmptyWait, out);
  EXPECT_NE(e.find("parity aliasing"), std::string::npos) << e;
}

TEST(SimtSyncSim, NamedBarriersOrderOnlyTheirThreads) {
  sim::SimtMemory mem;
  // Warps 0 and 1 meet at barrier 1: warp 1 reads what warp 0 wrote; warp 2 does not take part.
  auto body = [](bool outsider_reads) {
    return [outsider_reads](sim::SimtThread& t) {
      if (t.warp() == 0) t.St<uint32_t>(4 * t.lane(), 7u * t.lane() + 1);
      if (t.warp() < 2) t.NamedSync(1, 64);
      if (t.warp() == 1 && t.Ld<uint32_t>(4 * t.lane()) != 7u * t.lane() + 1)
        throw std::runtime_error("wrong value");
      if (t.warp() == 2 && outsider_reads) t.Ld<uint32_t>(4 * t.lane());
    };
  };
  EXPECT_EQ(RunBlock(mem, 96, 128, body(false)), "");
  EXPECT_NE(RunBlock(mem, 96, 128, body(true)).find("wrote with no barrier between"),
            std::string::npos);
  EXPECT_NE(
      RunBlock(mem, 96, 128, [](sim::SimtThread& t) { t.NamedSync(2, t.warp() == 0 ? 64 : 96); })
          .find("different thread counts"),
      std::string::npos);
}

TEST(SimtSyncSim, NamedBarrierTakenByMoreThanItsCountIsRefused) {
  sim::SimtMemory mem;
  const std::string e = RunBlock(mem, 96, 128, [](sim::SimtThread& t) { t.NamedSync(1, 64); });
  EXPECT_NE(e.find("96 threads wait at a barrier of 64"), std::string::npos) << e;
}

TEST(SimtSyncSim, NamedBarrierNeverFilledIsADeadlock) {
  sim::SimtMemory mem;
  const std::string e = RunBlock(mem, 96, 128, [](sim::SimtThread& t) {
    if (t.warp() == 0) t.NamedSync(3, 64);
  });
  EXPECT_NE(e.find("32 at a named barrier"), std::string::npos) << e;
}

TEST(SimtSyncSim, MbarrierMisuseIsRefused) {
  sim::SimtMemory mem;
  // Used by another thread with no barrier after the init.
  EXPECT_NE(RunBlock(mem, 32, 64,
                     [](sim::SimtThread& t) {
                       if (t.tid() == 0) t.MbarInit(0, 1);
                       if (t.tid() == 1) t.MbarArrive(0);
                     })
                .find("no barrier after its mbarrier.init"),
            std::string::npos);
  EXPECT_NE(RunBlock(mem, 32, 64,
                     [](sim::SimtThread& t) {
                       if (t.tid() == 0) t.MbarInit(0, 1), t.MbarInit(0, 1);
                     })
                .find("initialised twice"),
            std::string::npos);
  EXPECT_NE(RunBlock(mem, 32, 64,
                     [](sim::SimtThread& t) {
                       if (t.tid() == 0) t.MbarInit(8, 1), t.St<uint32_t>(12, 1u);
                     })
                .find("generic access to an mbarrier"),
            std::string::npos);
  EXPECT_NE(RunBlock(mem, 32, 64, [](sim::SimtThread& t) { t.MbarArrive(16); })
                .find("not an initialised mbarrier"),
            std::string::npos);
  // A phase that never completes: 32 arrivals expected, 31 come.
  const std::string e = RunBlock(mem, 64, 64, [](sim::SimtThread& t) {
    if (t.tid() == 0) t.MbarInit(0, 32);
    t.Sync();
    if (t.warp() == 0 && t.lane() != 5) t.MbarArrive(0);
    if (t.warp() == 1) t.MbarWait(0, 0);
  });
  EXPECT_NE(e.find("32 waiting on an mbarrier"), std::string::npos) << e;
  // Three phases complete before a thread waits for the first by its parity (0): the wait
  // passes on phase 2 — a phase gone by unwaited for.
  const std::string aliasing = RunBlock(mem, 64, 64, [](sim::SimtThread& t) {
    if (t.tid() == 0) t.MbarInit(0, 32);
    t.Sync();
    if (t.warp() == 1)
      for (int i = 0; i < 3; ++i) t.MbarArrive(0);
    t.Sync();
    if (t.warp() == 0) t.MbarWait(0, 0);
  });
  EXPECT_NE(aliasing.find("parity aliasing"), std::string::npos) << aliasing;
  // Waiting on the parity of a phase before the first: it passes at once (as on the GPU, where
  // producers start on empty barriers that way).
  EXPECT_EQ(RunBlock(mem, 32, 64,
                     [](sim::SimtThread& t) {
                       if (t.tid() == 0) t.MbarInit(0, 32);
                       t.Sync();
                       t.MbarWait(0, 1);
                     }),
            "");
}

// setmaxnreg is warpgroup-wide: all 128 threads, the same count.
TEST(SimtSyncSim, SetmaxnregIsTakenByWholeWarpgroups) {
  sim::SimtMemory mem;
  EXPECT_EQ(RunBlock(mem, 256, 64,
                     [](sim::SimtThread& t) {
                       if (t.tid() < 128) {
                         t.RegsDown<40>();
                       } else {
                         t.RegsUp<232>();
                       }
                     }),
            "");
  EXPECT_NE(RunBlock(mem, 128, 64,
                     [](sim::SimtThread& t) {
                       if (t.warp() == 0) {
                         t.RegsDown<40>();
                       } else {
                         t.RegsDown<48>();
                       }
                     })
                .find("different warpgroup-wide instructions"),
            std::string::npos);
  // One warp of the warpgroup takes it: the others never come.
  EXPECT_NE(RunBlock(mem, 128, 64,
                     [](sim::SimtThread& t) {
                       if (t.warp() == 0) t.RegsDown<40>();
                     })
                .find("32 in a warp-wide instruction"),
            std::string::npos);
}

TEST(SimtSyncSim, ACopyIsOrderedFromItsIssue) {
  std::vector<uint8_t> src(16);
  for (int i = 0; i < 16; ++i) src[i] = static_cast<uint8_t>(7 * i + 1);
  sim::SimtMemory mem;
  mem.Input(src.data(), src.size(), "src");
  // Thread 0 reads the bytes, thread 1 issues a copy over them; the barrier comes only before
  // the copy lands, too late.
  auto body = [&](bool sync_first) {
    return [&, sync_first](sim::SimtThread& t) {
      if (t.tid() == 1) t.St<uint32_t>(0, 9u);
      t.Sync();
      if (t.tid() == 0) t.Ld<uint32_t>(0);
      if (sync_first) t.Sync();
      if (t.tid() == 1) t.CpAsync16(0, src.data(), true), t.CpCommit();
      t.Sync();
      if (t.tid() == 1) {
        t.CpWait(0);
        uint32_t want;
        std::memcpy(&want, src.data(), 4);
        if (t.Ld<uint32_t>(0) != want) throw std::runtime_error("the copy did not land");
      }
    };
  };
  EXPECT_EQ(RunBlock(mem, 32, 64, body(true)), "");
  EXPECT_NE(RunBlock(mem, 32, 64, body(false)).find("write of a byte another thread read"),
            std::string::npos);
}

// Warp 0 writes a wgmma's operands (A 64 x 16, B 16 x 32, K-major core matrices) and publishes
// them on mbarrier `full`; warpgroup 1 waits, multiplies, and hands them back on `empty`; warp 0
// then overwrites them.
enum class Hand {
  kRight,
  kSkipFullWait,      // the warpgroup issues without waiting
  kFenceAfterArrive,  // the producer's fence.proxy.async after its arrive
  kOneArrival,        // one thread of the warpgroup arrives on empty (count 1)
  kSkipEmptyWait,     // the producer overwrites without waiting
};
constexpr uint32_t kA = 0, kB = 64 * 16 * 2, kBars = kB + 32 * 16 * 2;

std::string RunHandOff(Hand mode, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                       std::vector<float>& out) {
  out.assign(64 * 32, NAN);
  sim::SimtMemory mem;
  mem.Output(out.data(), out.size() * 4, "out");
  const uint32_t full = kBars, empty = kBars + 8;
  return RunBlock(mem, 256, kBars + 16, [&](sim::SimtThread& t) {
    const int tid = t.tid();
    if (tid == 0) t.MbarInit(full, 32), t.MbarInit(empty, mode == Hand::kOneArrival ? 1 : 128);
    t.Sync();
    if (tid < 128) {
      if (t.warp() != 0) return;
      for (int i = tid; i < 64 * 16; i += 32)
        t.St(kA + wgmma::TileAt(16, i / 16, i % 16 / 8) + (i % 8) * 2, a[i]);
      for (int i = tid; i < 16 * 32; i += 32)  // element (k, n) of B, stored [n][k]
        t.St(kB + wgmma::TileAt(16, i % 32, i / 32 / 8) + (i / 32 % 8) * 2, b[i]);
      if (mode != Hand::kFenceAfterArrive) t.FenceProxyAsync();
      t.MbarArrive(full);
      if (mode == Hand::kFenceAfterArrive) t.FenceProxyAsync();
      if (mode != Hand::kSkipEmptyWait) t.MbarWait(empty, 0);
      t.St<uint16_t>(kA + wgmma::TileAt(16, tid / 16, tid % 16 / 8) + (tid % 8) * 2, 0);  // its own
      return;
    }
    if (mode != Hand::kSkipFullWait) t.MbarWait(full, 0);
    float d[16] = {};
    t.WgmmaHold(d, 16);
    t.WgmmaFence();
    t.Wgmma(d, wgmma::Desc(t.SmemAddr(kA), 128, 256), wgmma::Desc(t.SmemAddr(kB), 128, 256), false);
    t.WgmmaCommit();
    t.WgmmaWait(0);
    t.WgmmaLanded(d, 16);
    if (mode != Hand::kOneArrival || tid == 128) t.MbarArrive(empty);
    const int w = (tid - 128) / 32, l = t.lane();
    for (int i = 0; i < 16; ++i)
      t.Gst(out.data() + (16 * w + wgmma::RowD(l, i)) * 32 + wgmma::ColD(l, i), d[i]);
  });
}

TEST(SimtSyncSim, AWgmmasReadsAreOrderedThroughEveryThreadOfItsWarpgroup) {
  std::mt19937 rng(4);
  std::normal_distribution<float> n01(0, 1);
  std::vector<uint16_t> a(64 * 16), b(16 * 32);
  for (auto* v : {&a, &b})
    for (uint16_t& x : *v) x = F32ToBF16(n01(rng));
  std::vector<float> out;
  ASSERT_EQ(RunHandOff(Hand::kRight, a, b, out), "");
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 32; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k)
        want += double(BF16ToF32(a[m * 16 + k])) * double(BF16ToF32(b[k * 32 + n]));
      ASSERT_FALSE(std::isnan(out[m * 32 + n]));
      EXPECT_NEAR(out[m * 32 + n], want, 1e-4 * (1 + std::abs(want))) << m << " " << n;
    }
  EXPECT_NE(RunHandOff(Hand::kSkipFullWait, a, b, out).find("no barrier before the wgmma"),
            std::string::npos);
  EXPECT_NE(RunHandOff(Hand::kFenceAfterArrive, a, b, out).find("without fence.proxy.async"),
            std::string::npos);
  EXPECT_NE(RunHandOff(Hand::kOneArrival, a, b, out).find("with no barrier after its wait"),
            std::string::npos);
  // The producer runs ahead to its next wait (none): its overwrite reaches the wgmma unordered.
  const std::string e = RunHandOff(Hand::kSkipEmptyWait, a, b, out);
  EXPECT_NE(e.find("no barrier before the wgmma"), std::string::npos) << e;
}

}  // namespace
}  // namespace attnd::cuda
