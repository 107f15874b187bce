// The tiered store (docs/architecture.md#tiers) against this machine's own limits, each figure a
// ratio of two numbers measured in the same run, printed as the markdown of
// bench/results/tiers.md:
//   1. spill and restore of one 32K-token sequence at DeepSeek-V3.2 dims (61 layers, fp8 cache)
//      to and from the host tier, against memcpy of the same bytes (the faster of one thread
//      and every core's, as the tier's copy runs on the device's threads), and to and from the disk
//      tier, against the disk's own sequential write and read of the same bytes (the same
//      directory, the same O_DIRECT-or-not mode, 16 MiB blocks);
//   2. a decode step of batch 8 with one sequence to restore (from the host, from the disk)
//      against the same step with none;
//   3. a multi-turn workload (conversations idle between turns, three times what the devices
//      hold): the context tokens workers did not have to prefill again, attnd's restore time
//      against its time to take those tokens again as prefills (a twin engine without tiers
//      that re-prefills them), and the new tokens' outputs compared bit for bit between the two;
//   4. exports of spilled sequences (a drain, a standby's copy) beside 8 in use filling the
//      device: each against an export of a sequence on the device, the pages moved to and from
//      the device meanwhile, and the next decode step against the one before.
//
//   build/bench/tier_bench [--dir DIR] [--context 32768] [--reps 3] [--parts 1234] [--quick]
// DIR is where the disk tier and the reference file go (default: the working directory; a real
// disk, not tmpfs). --quick: small sizes (a smoke run of every part, ~15 s).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_inputs.h"
#include "common/dtype.h"
#include "engine/engine.h"
#include "kv_store/cache_layout.h"
#include "kv_store/host_tier.h"
#include "tests/run_layer.h"

namespace attnd {
namespace {
using Clock = std::chrono::steady_clock;
using testing::RunLayerInto;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "tier_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}
void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(what, s);
}

struct Args {
  std::string dir = ".";
  int64_t context = 32768;
  int reps = 3;
  bool quick = false;
  std::string parts = "1234";  // --parts: which of the four to run
};

using bench::MakeInputs;
using bench::Tensors;

// One step's inputs, every layer: made once, replayed (the keys of a conversation's turn are
// the same on both engines of the workload).
struct StepInputs {
  Tensors tb;
  std::vector<LayerInputs> layers;
};
std::unique_ptr<StepInputs> MakeStep(const ModelSpec& s, int64_t T, bool write_only,
                                     uint32_t seed) {
  auto x = std::make_unique<StepInputs>();
  std::mt19937 rng(seed);
  for (LayerKind kind : s.layers)
    x->layers.push_back(MakeInputs(s, T, kind == LayerKind::kFull, write_only, x->tb, rng));
  return x;
}

// Runs a whole step; the outputs of every layer appended to *out (bf16 bits) when asked.
absl::Status Run(Engine& e, const std::vector<StepEntry>& batch, const StepInputs& in,
                 bool write_only, std::vector<uint16_t>* out = nullptr) {
  StepOptions o;
  if (write_only) o = StepOptions::WriteOnly();
  auto step = e.BeginStep(batch, o);
  if (!step.ok()) return step.status();
  const ModelSpec& s = e.options().spec;
  int64_t T = 0;
  for (const StepEntry& b : batch) T += b.q_len;
  std::vector<uint16_t> buf(write_only ? 0 : T * s.num_heads * s.kv_lora_rank);
  for (size_t l = 0; l < in.layers.size(); ++l) {
    absl::Status r = RunLayerInto(e, *step, static_cast<int>(l), in.layers[l],
                                  buf.empty() ? nullptr : buf.data(), buf.size() * 2);
    if (!r.ok()) return r;
    if (out != nullptr) out->insert(out->end(), buf.begin(), buf.end());
  }
  return absl::OkStatus();
}

// Imports `tokens` keys into a new sequence with write-only steps of 4096 (the same random
// chunk each time: the bytes' values do not matter to a copy).
void Import(Engine& e, const std::string& id, int64_t tokens, const StepInputs& chunk,
            int64_t chunk_tokens) {
  Check(e.OpenSequence(id), "open " + id);
  for (int64_t done = 0; done < tokens; done += chunk_tokens)
    Check(Run(e, {{id, chunk_tokens}}, chunk, true), "import " + id);
}

EngineOptions Options(const ModelSpec& spec, int32_t device_pages, int64_t host_pages,
                      int64_t disk_pages, const std::string& dir) {
  EngineOptions o;
  o.spec = spec;
  o.cache_dtype = DType::kFP8E4M3;
  o.pages_per_device = device_pages + 1;
  const size_t stride =
      TierStride(CacheLayout::ForModel(spec, o.cache_dtype, o.pages_per_device).BytesPerPage());
  o.tiers.host_bytes = stride * host_pages;
  if (disk_pages > 0) {
    o.tiers.disk_dir = dir;
    o.tiers.disk_bytes = stride * disk_pages;
    o.tiers.disk_file = absl::StrCat("tier_bench-", getpid(), ".pages");
  }
  return o;
}

double Best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// memcpy of `bytes` between two warm buffers, best of `reps` with one thread and with every
// core's thread each copying its share (the tier's copy uses the device's threads): seconds of
// the faster, and which it was.
std::pair<double, int> MemcpySeconds(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  double best = 1e30;
  int best_threads = 1;
  for (int threads : {1, cores}) {
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      std::vector<std::thread> pool;
      const size_t share = (bytes / threads + 63) / 64 * 64;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          const size_t at = std::min(bytes, t * share), n = std::min(share, bytes - at);
          std::memcpy(b.data() + at, a.data() + at, n);
        });
      for (std::thread& t : pool) t.join();
      const double s = Since(t0);
      if (s < best) best = s, best_threads = threads;
      if (b[bytes / 2] != 1) std::abort();
    }
  }
  return {best, best_threads};
}

// The disk's own sequential write and read of `bytes` in 16 MiB blocks, in `dir`, with O_DIRECT
// when `direct` (as the tier's file is), best of `reps`: {write seconds, read seconds}.
std::pair<double, double> DiskSeconds(const std::string& dir, size_t bytes, bool direct, int reps) {
  const std::string path = absl::StrCat(dir, "/tier_bench-ref-", getpid(), ".bin");
  constexpr size_t kBlock = size_t{16} << 20;
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, kBlock) != 0) std::abort();
  std::unique_ptr<void, decltype(&free)> block(raw, &free);
  std::memset(raw, 0x5a, kBlock);
  std::vector<double> w, r;
  for (int rep = 0; rep < reps; ++rep) {
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0600);
    if (fd < 0) Die("reference file", absl::ErrnoToStatus(errno, path));
    auto t0 = Clock::now();
    for (size_t off = 0; off < bytes; off += kBlock)
      if (pwrite(fd, raw, kBlock, static_cast<off_t>(off)) != static_cast<ssize_t>(kBlock))
        Die("reference write", absl::ErrnoToStatus(errno, path));
    w.push_back(Since(t0));
    if (!direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    t0 = Clock::now();
    for (size_t off = 0; off < bytes; off += kBlock)
      if (pread(fd, raw, kBlock, static_cast<off_t>(off)) != static_cast<ssize_t>(kBlock))
        Die("reference read", absl::ErrnoToStatus(errno, path));
    r.push_back(Since(t0));
    close(fd);
    unlink(path.c_str());
  }
  return {Best(w), Best(r)};
}

// Spill, then restore (a prefetch waited for), `reps` times: best seconds of each.
std::pair<double, double> SpillRestoreSeconds(Engine& e, const std::string& id, int reps) {
  std::vector<double> spill, restore;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    Check(e.OffloadSequences({id}), "offload");
    spill.push_back(Since(t0));
    t0 = Clock::now();
    e.PrefetchSequences({id});
    e.WaitForPrefetches();
    restore.push_back(Since(t0));
    if (e.DescribeSequence(id)->tier != Tier::kDevice) Die("restore", absl::InternalError("below"));
  }
  return {Best(spill), Best(restore)};
}

void SpillAndRestore(const Args& a) {
  const ModelSpec spec = PresetModelSpec("deepseek-v3.2").value();
  const int64_t tokens = a.quick ? 1024 : a.context;
  const int32_t pages = static_cast<int32_t>(tokens / spec.page_size);
  const int64_t chunk = std::min<int64_t>(4096, tokens);
  auto keys = MakeStep(spec, chunk, true, 1);
  std::printf("## 1. Spill and restore of one %lld-token sequence (%s, %d layers, fp8 cache)\n\n",
              static_cast<long long>(tokens), spec.name.c_str(), spec.num_layers());
  std::printf("| move | bytes | seconds | GB/s | reference | reference GB/s | ratio |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  {
    auto e = Engine::Create(Options(spec, pages, pages, 0, a.dir)).value();
    Import(*e, "s", tokens, *keys, chunk);
    const size_t bytes = static_cast<size_t>(pages) * e->Tiers()[0].bytes_per_page;
    auto [spill, restore] = SpillRestoreSeconds(*e, "s", a.reps);
    const auto [copy, threads] = MemcpySeconds(bytes, a.reps);
    const double ref = bytes / copy / 1e9;
    const std::string what =
        absl::StrCat("memcpy, ", threads, threads > 1 ? " threads" : " thread");
    std::printf("| spill device -> host | %zu | %.4f | %.2f | %s | %.2f | %.2f |\n", bytes, spill,
                bytes / spill / 1e9, what.c_str(), ref, copy / spill);
    std::printf("| restore host -> device | %zu | %.4f | %.2f | %s | %.2f | %.2f |\n", bytes,
                restore, bytes / restore / 1e9, what.c_str(), ref, copy / restore);
  }
  {
    auto e = Engine::Create(Options(spec, pages, 0, pages, a.dir)).value();
    Import(*e, "s", tokens, *keys, chunk);
    const TierCapacity disk = e->Tiers()[1];
    const size_t bytes = static_cast<size_t>(pages) * disk.bytes_per_page;
    auto [spill, restore] = SpillRestoreSeconds(*e, "s", a.reps);
    auto [w, r] = DiskSeconds(a.dir, bytes, disk.direct, a.reps);
    const char* mode = disk.direct ? "O_DIRECT" : "buffered";
    std::printf(
        "| spill device -> disk | %zu | %.4f | %.2f | sequential write, %s | %.2f | %.2f |\n",
        bytes, spill, bytes / spill / 1e9, mode, bytes / w / 1e9, w / spill);
    std::printf(
        "| restore disk -> device | %zu | %.4f | %.2f | sequential read, %s | %.2f | %.2f |\n",
        bytes, restore, bytes / restore / 1e9, mode, bytes / r / 1e9, r / restore);
  }
  std::printf(
      "\nratio: the reference's seconds over the tier's (1.0 = as fast as the machine's own "
      "copy or disk; best of %d each)\n\n",
      a.reps);
}

// The demo model's sizes parts 2 and 4 share: `context`-token sequences (512 with --quick), the
// pages each takes (with room to grow), imported in chunks of at most 4096 tokens; the keys of a
// chunk and a decode step of batch 8 (random, from `seed`).
struct DemoSizes {
  DemoSizes(const Args& a, uint64_t seed)
      : spec(PresetModelSpec("demo").value()),
        context(a.quick ? 512 : 8192),
        per_seq(static_cast<int32_t>(context / spec.page_size + 2)),
        chunk(std::min<int64_t>(4096, context)),
        keys(MakeStep(spec, chunk, true, seed)),
        decode(MakeStep(spec, 8, false, seed + 1)) {}
  // A `context`-token sequence `id` on e.
  void Import(Engine& e, const std::string& id) const {
    attnd::Import(e, id, context, *keys, chunk);
  }
  ModelSpec spec;
  int64_t context;
  int32_t per_seq;
  int64_t chunk;
  std::unique_ptr<StepInputs> keys, decode;
};

// Batch 8 of `context`-token sequences on a device holding 9: one decode step, and the same step
// with one sequence spilled first (an engine whose tier below is the host; one whose tier is
// the disk).
void DecodeWithARestore(const Args& a) {
  const DemoSizes d(a, 2);
  const ModelSpec& spec = d.spec;
  const int32_t per_seq = d.per_seq;
  const StepInputs& decode = *d.decode;
  const int reps = a.quick ? 2 : 2 * a.reps + 1;
  std::printf(
      "## 2. A decode step of batch 8 with one sequence to restore (%s: %d layers, %d "
      "heads, %lld-token contexts, fp8 cache)\n\n",
      spec.name.c_str(), spec.num_layers(), spec.num_heads, static_cast<long long>(d.context));
  std::printf(
      "| tier below | none to restore: median s (best) | one to restore: median s (best) "
      "| ratio of medians |\n|---|---|---|---|\n");
  for (const bool disk : {false, true}) {
    auto e = Engine::Create(
                 Options(spec, 9 * per_seq, disk ? 0 : 2 * per_seq, disk ? 2 * per_seq : 0, a.dir))
                 .value();
    std::vector<StepEntry> batch;
    for (int i = 0; i < 8; ++i) {
      const std::string id = absl::StrCat("d", i);
      d.Import(*e, id);
      batch.push_back({id, 1});
    }
    std::vector<double> none, one;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      Check(Run(*e, batch, decode, false), "decode");
      none.push_back(Since(t0));
      Check(e->OffloadSequences({"d3"}), "offload");
      if (e->DescribeSequence("d3")->tier != (disk ? Tier::kDisk : Tier::kHost))
        Die("offload", absl::InternalError("not where it should be"));
      t0 = Clock::now();
      Check(Run(*e, batch, decode, false), "decode with a restore");
      one.push_back(Since(t0));
    }
    std::printf("| %s | %.4f (%.4f) | %.4f (%.4f) | %.2f |\n", disk ? "disk" : "host", Median(none),
                Best(none), Median(one), Best(one), Median(one) / Median(none));
  }
  std::printf("\n");
}

// Conversations of several turns, idle between them, three times what the devices hold. On the
// tiered engine a turn prefills its new tokens and decodes; on the twin without tiers (as a
// worker must when its conversation's pages were freed) the turn first prefills the whole
// context again. The new tokens' outputs must be the same bits on both.
void MultiTurn(const Args& a) {
  const ModelSpec spec = PresetModelSpec("demo").value();
  const int convs = 12, turns = 3, device_convs = 4;
  const int64_t turn_tokens = a.quick ? 128 : 1024, decode = 4;
  const int64_t max_len = turns * (turn_tokens + decode);
  const int32_t per_conv = static_cast<int32_t>(max_len / spec.page_size + 2);
  EngineOptions tiered_o =
      Options(spec, device_convs * per_conv, 4 * per_conv, convs * per_conv, a.dir);
  std::mutex events_mu;
  double restore_s = 0, spill_s = 0;  // the copies' own seconds, from the engine's events
  tiered_o.on_tier_event = [&](const TierEvent& ev) {
    std::lock_guard<std::mutex> lock(events_mu);
    (ev.kind == TierEvent::Kind::kRestore ? restore_s : spill_s) += ev.seconds;
  };
  auto tiered = Engine::Create(tiered_o).value();
  EngineOptions plain_o = Options(spec, per_conv + 4, 0, 0, a.dir);
  auto plain = Engine::Create(plain_o).value();
  // Each conversation's turns: the prompt's keys and queries, and its decode steps.
  std::vector<std::vector<std::unique_ptr<StepInputs>>> prompt(convs), dec(convs);
  for (int c = 0; c < convs; ++c)
    for (int t = 0; t < turns; ++t) {
      prompt[c].push_back(MakeStep(spec, turn_tokens, false, 1000 + c * 10 + t));
      for (int d = 0; d < decode; ++d)
        dec[c].push_back(MakeStep(spec, 1, false, 5000 + c * 100 + t * 10 + d));
    }
  double tiered_s = 0, plain_s = 0, reprefill_s = 0;
  int64_t reused_tokens = 0;
  bool same = true;
  for (int c = 0; c < convs; ++c) Check(tiered->OpenSequence(absl::StrCat("c", c)), "open");
  for (int t = 0; t < turns; ++t) {
    for (int c = 0; c < convs; ++c) {
      const std::string id = absl::StrCat("c", c);
      std::vector<uint16_t> got, want;
      // Tiered: the new tokens, then decode (a restore first when it spilled meanwhile).
      auto t0 = Clock::now();
      Check(Run(*tiered, {{id, turn_tokens}}, *prompt[c][t], false, &got), "tiered prompt");
      for (int d = 0; d < decode; ++d)
        Check(Run(*tiered, {{id, 1}}, *dec[c][t * decode + d], false, &got), "tiered decode");
      tiered_s += Since(t0);
      // Without tiers: the context again (every earlier turn's prompt and decode steps, timed
      // apart), then the same new tokens.
      Check(plain->OpenSequence(id), "open plain");
      t0 = Clock::now();
      for (int u = 0; u < t; ++u) {
        Check(Run(*plain, {{id, turn_tokens}}, *prompt[c][u], false), "re-prefill");
        for (int d = 0; d < decode; ++d)
          Check(Run(*plain, {{id, 1}}, *dec[c][u * decode + d], false), "re-prefill decode");
        reused_tokens += turn_tokens + decode;
      }
      reprefill_s += Since(t0);
      t0 = Clock::now();
      Check(Run(*plain, {{id, turn_tokens}}, *prompt[c][t], false, &want), "plain prompt");
      for (int d = 0; d < decode; ++d)
        Check(Run(*plain, {{id, 1}}, *dec[c][t * decode + d], false, &want), "plain decode");
      plain_s += Since(t0);
      Check(plain->CloseSequence(id), "close plain");
      same = same && got == want;
    }
  }
  const EngineCounters k = tiered->Counters();
  std::printf(
      "## 3. Multi-turn: %d conversations x %d turns of %lld prompt + %lld decode "
      "tokens, devices holding %d (%s, %d layers, fp8)\n\n",
      convs, turns, static_cast<long long>(turn_tokens), static_cast<long long>(decode),
      device_convs, spec.name.c_str(), spec.num_layers());
  std::printf("| figure | value |\n|---|---|\n");
  std::printf("| context tokens workers did not prefill again | %lld |\n",
              static_cast<long long>(reused_tokens));
  std::printf("| spills, restores (by a step) | %lld, %lld |\n", static_cast<long long>(k.spills),
              static_cast<long long>(k.restores_step));
  std::printf("| attnd seconds, tiered: new tokens incl. restores | %.3f |\n", tiered_s);
  std::printf("| attnd seconds, without tiers: new tokens | %.3f |\n", plain_s);
  std::printf("| attnd seconds, without tiers: those context tokens again | %.3f |\n", reprefill_s);
  std::printf("| attnd seconds, tiered: restores' copies (spills' copies) | %.3f (%.3f) |\n",
              restore_s, spill_s);
  std::printf("| restore time / re-prefill time | %.3f |\n", restore_s / reprefill_s);
  std::printf("| (tiered - without tiers) new-token time / re-prefill time | %.3f |\n",
              (tiered_s - plain_s) / reprefill_s);
  std::printf("| new tokens' outputs bit for bit the same | %s |\n\n", same ? "yes" : "NO");
  if (!same) std::exit(1);
}

// Every row of every layer of `id`, as an export reads it (chunks of 4096 tokens, each layer of
// a chunk in turn: ExportSequence's and a drain's order): seconds.
double ExportSeconds(Engine& e, const std::string& id) {
  const int64_t n = e.DescribeSequence(id)->length;
  const auto t0 = Clock::now();
  for (int64_t begin = 0; begin < n; begin += 4096)
    for (int layer = 0; layer < e.spec().num_layers(); ++layer)
      Check(e.ReadRows(id, layer, begin, std::min<int64_t>(n, begin + 4096)).status(), "export");
  return Since(t0);
}

// A replica with 8 sequences in use filling its device and 8 spilled (4 on the host, 4 on the
// disk) exports the spilled ones (a drain, a standby's copy): they are read where they are, so
// the 8 in use keep the device and the next decode step restores nothing.
void ExportSpilled(const Args& a) {
  const DemoSizes d(a, 4);
  const ModelSpec& spec = d.spec;
  const int32_t per_seq = d.per_seq;
  const StepInputs& decode = *d.decode;
  auto e = Engine::Create(Options(spec, 8 * per_seq, 4 * per_seq, 8 * per_seq, a.dir)).value();
  std::vector<StepEntry> batch;
  for (int i = 0; i < 8; ++i) {
    d.Import(*e, absl::StrCat("s", i));
    Check(e->OffloadSequences({absl::StrCat("s", i)}), "offload");  // the 4 first go on to disk
  }
  for (int i = 0; i < 8; ++i) {
    d.Import(*e, absl::StrCat("d", i));
    batch.push_back({absl::StrCat("d", i), 1});
  }
  Check(Run(*e, batch, decode, false), "decode");
  std::vector<double> before, host, disk, device;
  for (int r = 0; r < std::max(3, a.reps); ++r) {
    auto t0 = Clock::now();
    Check(Run(*e, batch, decode, false), "decode");
    before.push_back(Since(t0));
  }
  for (int r = 0; r < a.reps; ++r) device.push_back(ExportSeconds(*e, "d0"));
  const EngineCounters c0 = e->Counters();
  for (int i = 0; i < 8; ++i) {
    const std::string id = absl::StrCat("s", i);
    const Tier was = e->DescribeSequence(id)->tier;
    (was == Tier::kDisk ? disk : host).push_back(ExportSeconds(*e, id));
  }
  const EngineCounters c1 = e->Counters();
  if (host.empty() || disk.empty()) Die("export", absl::InternalError("no export from a tier"));
  int on_device = 0;  // right after the exports
  for (int i = 0; i < 8; ++i)
    on_device += e->DescribeSequence(absl::StrCat("d", i))->tier == Tier::kDevice;
  auto t0 = Clock::now();
  Check(Run(*e, batch, decode, false), "decode");
  const double first_after = Since(t0);
  std::printf(
      "## 4. Exporting spilled sequences beside 8 in use (%s: %d layers, %lld-token "
      "contexts, fp8 cache; 4 on the host, 4 on the disk)\n\n",
      spec.name.c_str(), spec.num_layers(), static_cast<long long>(d.context));
  std::printf("| figure | value |\n|---|---|\n");
  std::printf("| export of a sequence on the device: s (best of %d) | %.4f |\n", a.reps,
              Best(device));
  std::printf("| export of a sequence on the host: median s, / device | %.4f, %.2f |\n",
              Median(host), Median(host) / Best(device));
  std::printf(
      "| export of a sequence on the disk (up to the host): median s, / device | %.4f, %.2f |\n",
      Median(disk), Median(disk) / Best(device));
  // Pages copied onto and off the devices during the exports.
  const int64_t page = static_cast<int64_t>(e->Tiers()[0].bytes_per_page);
  auto moved = [&](int from, int to) {
    return (c1.tier_bytes[from][to] - c0.tier_bytes[from][to]) / page;
  };
  std::printf("| pages copied onto the device, off it, during the exports | %lld, %lld |\n",
              static_cast<long long>(moved(1, 0) + moved(2, 0)),
              static_cast<long long>(moved(0, 1) + moved(0, 2)));
  std::printf("| sequences in use still on the device after them | %d of 8 |\n", on_device);
  std::printf("| the first decode step of the 8 after them / one before (median) | %.2f |\n\n",
              first_after / Median(before));
}

}  // namespace
}  // namespace attnd

int main(int argc, char** argv) {
  attnd::Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "tier_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--dir") {
      a.dir = value();
    } else if (arg == "--context") {
      a.context = std::atoll(value().c_str());
    } else if (arg == "--reps") {
      a.reps = std::max(1, std::atoi(value().c_str()));
    } else if (arg == "--parts") {
      a.parts = value();
    } else if (arg == "--quick") {
      a.quick = true;
      a.reps = 1;
    } else {
      std::fprintf(stderr,
                   "usage: tier_bench [--dir DIR] [--context TOKENS] [--reps N] [--parts 1234] "
                   "[--quick]\n");
      return 2;
    }
  }
  if (a.context < 64 || a.context % 4096 != 0) {
    std::fprintf(stderr, "tier_bench: --context must be a multiple of 4096\n");
    return 2;
  }
  std::printf("# tier_bench (--dir %s)\n\n", a.dir.c_str());
  if (a.parts.find('1') != std::string::npos) attnd::SpillAndRestore(a);
  if (a.parts.find('2') != std::string::npos) attnd::DecodeWithARestore(a);
  if (a.parts.find('3') != std::string::npos) attnd::MultiTurn(a);
  if (a.parts.find('4') != std::string::npos) attnd::ExportSpilled(a);
  return 0;
}
