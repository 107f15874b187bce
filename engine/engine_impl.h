// The engine's private state, shared by the files that implement it: engine.cc (lifecycle,
// sequences, steps' ends), admission.cc (BeginStep's checks and reservations) and layer_run.cc
// (the layer call). Not part of the API: include engine/engine.h.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/thread_pool.h"
#include "engine/absorption_holder.h"
#include "engine/engine.h"
#include "engine/engine_mutex.h"
#include "engine/row_reader.h"
#include "engine/step_fates.h"
#include "engine/step_plan.h"
#include "kernels/device.h"
#include "kv_store/disk_tier.h"
#include "kv_store/host_tier.h"
#include "kv_store/sequence_table.h"

namespace attnd {

using EngineClock = std::chrono::steady_clock;

// One batch entry of a step, from admission to commit: what BeginStep asked (StepEntry), the
// sequence it binds and the pages it reserved.
struct StepSeq {
  Sequence* seq = nullptr;
  int64_t q_len = 0;
  int64_t new_len = 0;                  // the sequence's length once the step commits
  int64_t offset = 0, query_pos = 0;    // context parallelism (StepEntry)
  std::vector<int32_t> new_pages;       // reserved by the step, owned by it until commit
  std::vector<BlockHash> block_hashes;  // of the blocks it completes (StepEntry), indexed at commit
  std::vector<int32_t> table;           // seq->pages + new_pages
};

struct Step {
  uint64_t id = 0;
  std::string tenant;
  uint64_t channel = 0;
  std::vector<StepSeq> seqs;
  int64_t tokens = 0;
  int64_t visible_keys = 0;  // sum over the queries of the keys each sees (position + 1)
  int64_t topk_keys = 0;     // the same with each capped at K
  StepOptions options;
  bool counted = true;  // against its tenant's open steps (a step of standby copies is not)
  int next_layer = 0;
  bool candidates_given = false;  // context parallelism: next_layer's kCandidates call ran
  bool busy = false;
  bool abort_requested = false;
  AbortReason abort_reason = AbortReason::kAbort;  // of a requested abort
  EngineClock::time_point begun;
  StepPhase phase = StepPhase::kDecode;  // set once at admission
  EngineClock::time_point last_used;
  StepPlan plan;
  std::vector<std::unique_ptr<DeviceStep>> on_device;  // [plan.shares]
};

// What a batch lacks before its step can be admitted (TryBegin): sequences to bring to their
// devices, and pages beyond each device's free ones.
struct Shortfall {
  std::vector<SequenceKey> restore;
  std::vector<int32_t> pages;  // [device]
  // Set only when the whole batch passed every other check: a batch refused for what it is
  // (an unknown sequence after a spilled one, say) moves nothing.
  bool checked = false;
  bool any() const {
    if (!checked) return false;
    if (!restore.empty()) return true;
    for (int32_t p : pages)
      if (p > 0) return true;
    return false;
  }
};

struct Engine::Impl {
  EngineOptions options;
  std::string cache_sizing;
  std::string cpu_isa;  // what options.device.cpu_isa resolved to ("avx2", ...)
  const ModelSpec& spec() const { return options.spec; }
  std::unique_ptr<ThreadPool> pool;
  std::vector<std::unique_ptr<Device>> devices;  // fixed after Create: read without mu
  AbsorptionHolder absorption;                   // its own locks

  mutable EngineMutex mu;                  // guards everything below (engine_mutex.h)
  std::condition_variable_any step_ended;  // notified whenever a step ends, a layer or a copy does
  std::unique_ptr<SequenceTable> table;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Step>> steps;
  EngineCounters counters;  // device_compute_seconds kept in compute_ns below
  std::unique_ptr<std::atomic<int64_t>[]> compute_ns;  // per device, without mu
  StepFates fates;  // what a late message for an ended step is told

  // --- steps' ends (engine.cc); mu held ---
  // Returns an unregistered (or registered) step's pages and sequences.
  void Release(Step* step);
  // Takes an ended step out of the table. The caller destroys it after releasing mu: freeing a
  // device's step state may wait for that device.
  std::unique_ptr<Step> Retire(Step* step);
  // `why` is what a later message for this step is told (CANCELLED or DEADLINE_EXCEEDED).
  [[nodiscard]] std::unique_ptr<Step> AbortLocked(Step* step, absl::Status why, AbortReason reason);
  [[nodiscard]] std::unique_ptr<Step> CommitLocked(Step* step);
  // The open step `ref`, or the status its fate (or absence) gives; another tenant's step reads
  // exactly as one that does not exist.
  absl::StatusOr<Step*> FindStep(const StepRef& ref) const;
  static bool Owns(const Step& st, const StepRef& ref) {
    return st.tenant == ref.tenant && st.channel == ref.channel;
  }
  // A fresh step id: random, never 0, never one open or remembered.
  uint64_t NewStepId() const;

  // --- admission (admission.cc) ---
  // Validates a batch, reserves its pages and binds its sequences (mu held), or changes nothing.
  // *retry: a sequence is held by a step running a layer, or is being copied.
  absl::StatusOr<std::unique_ptr<Step>> TryBegin(const std::vector<StepEntry>& batch,
                                                 const StepOptions& options, bool* retry,
                                                 Shortfall* need = nullptr);
  // Builds the plan and each device's step state for a bound step (mu not held).
  absl::Status Prepare(Step& st);
  // OK when every device serves context parallelism and the model has no sliding window.
  absl::Status ContextParallelServed() const;

  // --- the layer call (layer_run.cc) ---
  // Engine::RunLayer: the step's layer order, its busy flag, aborting it on any error;
  // advances it unless the call gave candidates.
  absl::StatusOr<LayerResult> Run(const StepRef& ref, LayerSource& source, LayerSink* sink);
  // What DescribeStep says of a step (read under the lock, or by the layer that holds it busy).
  static Engine::StepInfo InfoOf(const Step& st);
  // Every rule of a call against its step (st busy: its fields are stable), or the error.
  absl::StatusOr<LayerShape> CheckRequest(const Step& st, const LayerRequest& request,
                                          const Absorption* absorb) const;
  // Checks the bytes, runs the layer on every device and fills `result`; st is busy.
  absl::Status Compute(Step& st, const LayerRequest& request, const LayerShape& shape, void* out,
                       const Absorption* absorb, LayerResult* result);

  // Runs a PageMove's copies (mu not held).
  absl::Status Copy(const PageMove& move);

  // --- tiers (tiering.cc): host and disk below the devices; mu held on entry and exit of the
  // *Locked methods, released while bytes are copied ---
  std::unique_ptr<HostTier> host;
  // The disk tier's transfers: several pages in flight (a deeper queue, and one page's checksum
  // computed while another's bytes travel).
  std::unique_ptr<ThreadPool> disk_io;
  std::unique_ptr<DiskTier> disk;
  bool tiers_on() const { return host != nullptr || disk != nullptr; }
  // The prefetch worker: restores queued sequences in the background.
  std::thread prefetcher;
  std::deque<SequenceKey> prefetch_queue;
  absl::flat_hash_set<SequenceKey> prefetch_queued;  // what prefetch_queue holds
  std::condition_variable_any prefetch_wake;
  bool prefetching = false;
  int64_t moves_in_flight = 0;  // tier moves copying with the lock released  // the worker is
                                // restoring one (step_ended is notified after)
  bool stopping = false;
  void PrefetchLoop();
  // Creates the tiers the options ask for (Engine::Create).
  absl::Status CreateTiers(const CacheLayout& layout);
  // Copies a tier move's bytes (mu not held); pages whose bytes could not be read go to *lost.
  absl::Status CopyTierBytes(const TierMove& move, std::vector<int32_t>* lost);
  // Runs a planned move: copies, then ends it (ok, or as before, or with lost sequences).
  absl::Status RunTierMove(EngineLock& lock, const TierMove& move, TierEvent::Reason reason);
  // Moves `key` to `to`.
  absl::Status MoveLocked(EngineLock& lock, const SequenceKey& key, Tier to,
                          TierEvent::Reason reason);
  // Spills `key` down: to the host (demoting the host's least recently used to disk for room),
  // or to the disk when the host tier is full or off.
  absl::Status SpillLocked(EngineLock& lock, const SequenceKey& key, TierEvent::Reason reason);
  // Brings `key` to its device (waiting for a move of it in flight; making room), keeping the
  // sequences in `keep` where they are.
  absl::Status RestoreLocked(EngineLock& lock, const SequenceKey& key, TierEvent::Reason reason,
                             const std::vector<const Sequence*>& keep = {});
  // Frees `need` pages of `device` (orphans first, then its least recently used sequences),
  // never moving those in `keep`. RESOURCE_EXHAUSTED naming every tier when nothing can go.
  absl::Status MakeRoom(EngineLock& lock, int device, int32_t need,
                        const std::vector<const Sequence*>& keep);
  // Frees `need` host slots (host orphans, then the host's least recently used, to disk).
  absl::Status MakeHostRoom(EngineLock& lock, int32_t need);
  // What every tier holds, for a RESOURCE_EXHAUSTED message.
  std::string TierUse() const;
  // Readies `key` to be read where it is (Engine::ReadRows): a sequence on the device or the host
  // stays; one on the disk comes up to the host (its pages are read whole, once, not once per
  // layer), or to its device without a host tier. DATA_LOSS for a lost sequence.
  absl::Status LiftForRead(EngineLock& lock, const SequenceKey& key);
  // Rows [begin, end) of `layer` from pages pinned by PinTierRows (mu not held).
  absl::Status ReadTierRows(int device, int layer, const std::vector<TierPin>& pins, int64_t begin,
                            int64_t end, LayerRowBytes* out) const;
  // Waits (mu held) while `key` or a page it holds is moving or being read where it is, up to the
  // begin-wait; false on timeout.
  bool AwaitSettled(EngineLock& lock, const SequenceKey& key);
  // The same, DEADLINE_EXCEEDED saying so on timeout.
  absl::Status AwaitSettledOrSay(EngineLock& lock, const SequenceKey& key);
  void Emit(const TierEvent& e) const {
    if (options.on_tier_event) options.on_tier_event(e);
  }
};

}  // namespace attnd
