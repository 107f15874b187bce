// The attention engine: sequences, steps and the per-layer DSA computation over paged caches on
// one or more devices. No gRPC here: the service drives this API.
//
// Usage:
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(options));
//   RETURN_IF_ERROR(engine->OpenSequence("req-1"));
//   ASSIGN_OR_RETURN(uint64_t step, engine->BeginStep({{"req-1", 128}}));   // prefill 128
//   for (int l = 0; l < spec.num_layers(); ++l) {
//     BufferSink out(buffer, bytes);  // or the caller's own LayerSink
//     ASSIGN_OR_RETURN(LayerResult r, engine->RunLayer(step, {l, inputs[l]}, &out));
//   }                                                       // the last layer commits
//
// Thread safety: every method may be called from any thread. Layers of different steps run
// concurrently; one step's layers run one at a time and in order.
//
// Tenants (docs/trust.md): every sequence and step belongs to a tenant (SequenceKey, StepRef; a
// bare id names the anonymous tenant ""). Another tenant's sequence or step answers NOT_FOUND
// exactly as one that does not exist; step ids are random 64-bit values; quotas bound what each
// holds.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/absorption.h"
#include "common/model_spec.h"
#include "common/tensor.h"
#include "engine/layer_request.h"
#include "engine/row_reader.h"
#include "kernels/device_factory.h"
#include "kv_store/disk_tier.h"
#include "kv_store/page_directory.h"
#include "kv_store/sequence_table.h"
#include "kv_store/tenant_ledger.h"

namespace attnd {

// Per-request bounds, checked before any work or memory is spent (docs/trust.md).
struct EngineLimits {
  int64_t max_step_tokens = 65536;   // sum of q_len over one step's batch
  int64_t max_batch_entries = 4096;  // sequences in one step
  int64_t max_sequences = 65536;     // open sequences
  size_t max_id_bytes = 256;         // a sequence id's length
  bool check_finite = true;          // refuse NaN/Inf in any input tensor
  // How long BeginStep waits for a conflicting step that is running a layer (it may be aborting:
  // a cancel takes effect when the layer ends) before answering FAILED_PRECONDITION.
  std::chrono::milliseconds abort_wait{10000};
  // Every tenant's quota unless Engine::SetTenantQuotas overrides it (0 = no limit).
  TenantQuota tenant_quota;
};

// The tiers below the devices (docs/architecture.md#tiers): when a device's pages run out, the
// least recently stepped sequences spill to host memory and, below it, to a local disk, and
// come back when a step needs them, bit for bit. A tier of 0 bytes is off.
struct TierOptions {
  size_t host_bytes = 0;  // --host-cache-bytes
  std::string disk_dir;   // --disk-cache-dir ("" = no disk tier)
  size_t disk_bytes = 0;  // --disk-cache-bytes
  // The page file's name in disk_dir: unique per process sharing the directory (the server uses
  // its replica name). A previous process's file of this name is removed at start.
  std::string disk_file = "attnd-pages.bin";
  std::shared_ptr<DiskTier::Io> disk_io;  // tests: replaceable system calls (faults)
};

// One tier move, for metrics and logs (EngineOptions::on_tier_event).
struct TierEvent {
  enum class Kind { kSpill, kRestore, kDataLoss };
  enum class Reason { kStep, kPrefetch, kOffload, kIdle, kRoom, kUse };
  Kind kind = Kind::kSpill;
  Reason reason = Reason::kRoom;
  Tier from = Tier::kDevice, to = Tier::kHost;
  std::string tenant, sequence;  // empty for pages no sequence needed where they were
  int64_t pages = 0, bytes = 0;
  double seconds = 0;
  std::string detail;  // data loss: what failed (the disk tier's file, slot and error)
};
const char* TierReasonName(TierEvent::Reason reason);

struct EngineOptions {
  ModelSpec spec;
  DType cache_dtype = DType::kBF16;  // bf16 in production; fp32 for exactness tests
  int num_devices = 1;               // CPU devices cpu:0..cpu:N-1 (when `devices` is empty)
  // Explicit devices, in order: "cpu:N" or "cuda:N" (cuda needs a CUDA build and that GPU).
  std::vector<std::string> devices;
  int32_t pages_per_device = 0;  // pages incl. the reserved page 0; 0 = use cache_bytes
  size_t cache_bytes_per_device = size_t{1} << 30;
  // > 0 (and no pages_per_device): the cache is this fraction of each device's available memory
  // instead of cache_bytes_per_device (kernels/device_factory.h CacheBytesForFraction).
  double cache_fraction = 0;
  // The CPU inner loops and each GPU's scratch (kernels/device_factory.h; tests sweep every
  // supported ISA).
  DeviceSettings device;
  int threads = 0;  // compute threads; 0 = all cores
  EngineLimits limits;
  // Server-side absorption's weights (--absorb-from): calls may then give q_nope instead of
  // q_latent and get [T, H, V] back. Null: none (SetAbsorption may add them later).
  std::shared_ptr<const Absorption> absorption;
  TierOptions tiers;
  // Called after every tier move and data loss, off the engine's lock (metrics, logs).
  std::function<void(const TierEvent&)> on_tier_event;
  // The prefix cache (docs/prefix_cache.md): bytes of pages only the cache may hold (blocks of
  // closed sequences, least recently used out first; in whole pages); < 0: as many as the tiers
  // hold (they leave when a request needs their room); 0: blocks stay findable only while a
  // sequence holds them.
  int64_t prefix_cache_bytes = -1;
  // Standby replicas (docs/replication.md): bytes of pages standby copies may hold (in whole
  // pages; < 0: no limit beyond the cache's). Standby copies do not count against tenants.
  int64_t standby_cache_bytes = -1;
  // Hears every block indexed or removed (KV events), under the engine's lock: it must be quick
  // and must not call the engine.
  std::function<void(const PrefixEvent&)> on_prefix_event;
};

// What a new sequence asks of the prefix cache (Engine::OpenSequence): its prompt's block
// hashes (common/block_hash.h), the token ids of those blocks when the caller has them (for KV
// events; empty otherwise), and how many blocks it may take at most (a worker that sent its
// whole prompt's tokens needs the last token prefilled, so the service caps it below them).
struct PrefixQuery {
  std::vector<BlockHash> hashes;
  std::vector<uint32_t> tokens;
  int64_t max_blocks = INT64_MAX;
};

// One batch entry of a step: `q_len` new tokens for the sequence.
struct StepEntry {
  std::string sequence_id;
  int64_t q_len = 0;
  // Context-parallel steps only (StepOptions::context_parallel): the absolute position of this
  // server's first key of the sequence (a multiple of page_size), and on attend-only steps the
  // absolute position of the entry's first query (at least position_offset + length).
  int64_t position_offset = 0;
  int64_t query_position = 0;
  // The prefix cache: the hashes of the blocks (pages) this entry's tokens complete, in order,
  // or none. When the step commits, they are indexed (with the blocks before them whose hashes
  // the sequence knows) so later sequences find them. Not on context-parallel steps.
  std::vector<BlockHash> block_hashes = {};
  // Nonzero: the sequence's generation as the caller knows it (docs/replication.md); a step
  // naming another one is FAILED_PRECONDITION (the sequence failed over elsewhere: fenced).
  uint64_t generation = 0;
  // >= 0: the tokens the sequence must hold before the step (another length is
  // FAILED_PRECONDITION): a resent step that was taken already is refused.
  int64_t start = -1;
};

// How a step runs.
struct StepOptions {
  // Write the new tokens' keys (kv_latent, k_rope, and index_k on full layers) and compute
  // nothing: importing a prefix computed elsewhere (a KV handoff). Layers take no queries and
  // produce no output.
  bool write_only = false;
  // Whose step: every sequence of the batch is looked up in this tenant's namespace, and only
  // this tenant may drive or abort the step.
  std::string tenant;
  // Nonzero: the step is bound to this channel (the service's Step stream that began it); only a
  // StepRef with the same channel finds it.
  uint64_t channel = 0;

  // Context parallelism (engine/context_parallel.h, docs/numerics.md): this server holds a slice of
  // each sequence, from its entry's position_offset on. Full layers then take two calls,
  // RunCandidates and RunLayer with LayerInputs::selection. Not with write_only or a sliding
  // window; on devices that serve it (Device::SupportsContextParallel: CPU and CUDA).
  bool context_parallel = false;
  // With context_parallel: the entries' queries come after every key this server holds (another
  // server holds their tokens), at their query_position; nothing is written.
  bool attend_only = false;
  // Whether the step may write standby copies (docs/replication.md). The service sets it only
  // for the admin identity (the replicas' peer credentials) or a server without tenants: a
  // tenant's own steps never write its copies, whose pages the standby budget pays for, not its
  // quota. A step of copies does not count against the tenant's open steps either.
  bool standby_writer = true;
  // Whether the step may write a sequence still being imported (a handoff's or drain's target).
  // The service clears it without --auth for callers that are not the admin: only the admin
  // opens such a target there, so only it may fill one (tenants fill their own).
  bool import_writer = true;
  // Set: the step's last layer (its commit) does not start after this; it is aborted instead
  // (UNAVAILABLE). The service sets it to when the replica's lease on the step's standby copies
  // runs out (docs/replication.md#leases).
  std::chrono::steady_clock::time_point commit_by{};

  static StepOptions WriteOnly() {
    StepOptions o;
    o.write_only = true;
    return o;
  }
};

// An open step, as its tenant (and channel) name it; a bare id: the anonymous tenant, no channel.
struct StepRef {
  StepRef(uint64_t id) : id(id) {}  // NOLINT: the anonymous tenant
  StepRef(std::string tenant, uint64_t id, uint64_t channel = 0)
      : id(id), tenant(std::move(tenant)), channel(channel) {}
  uint64_t id;
  std::string tenant;
  uint64_t channel = 0;
};

struct SequenceInfo {
  std::string tenant;
  std::string id;
  int64_t length = 0;  // committed tokens
  int device = 0;
  std::vector<int32_t> pages;  // physical page ids on the device, in order (empty elsewhere)
  bool in_step = false;
  bool importing = false;     // a handoff target not yet at its import length
  Tier tier = Tier::kDevice;  // where it is (docs/architecture.md#tiers)
  bool moving = false;        // between tiers now
  bool lost = false;          // its pages could not be read back: DATA_LOSS on use
  uint64_t generation = 1;    // promotions so far + 1 (docs/replication.md)
  bool standby = false;       // a standby copy: write-only steps only until promoted
};

// Standby copies' share of the cache (docs/replication.md).
struct StandbyUsage {
  int64_t sequences = 0;
  int64_t pages = 0;
  int64_t budget_pages = -1;  // < 0: no limit
};

// Why a step was aborted (metrics count aborts by reason).
enum class AbortReason { kError, kAbort, kCancel, kExpiry, kDrain };
inline constexpr int kNumAbortReasons = 5;
// "error", "abort", "cancel", "expiry", "drain".
const char* AbortReasonName(AbortReason reason);

// What a step does, for metrics: an import (write-only), a decode (every entry q_len 1) or a
// prefill (anything else, mixed batches included).
enum class StepPhase { kPrefill, kDecode, kImport };
const char* StepPhaseName(StepPhase phase);

// Monotonic totals since start, for metrics.
struct EngineCounters {
  int64_t steps_committed = 0;
  int64_t steps_aborted[kNumAbortReasons] = {};
  // New tokens of committed steps, counted once per step (not per layer), by the entry's kind:
  // q_len 1 decode, longer prefill, write-only import.
  int64_t tokens_prefill = 0, tokens_decode = 0, tokens_import = 0;
  int64_t sequences_expired = 0;  // closed by ExpireIdleSequences (their lease ran out)
  std::vector<double> device_compute_seconds;  // per device: time spent computing layers
  // Tiers: bytes moved [from][to] (index by Tier), sequences spilled and restored (by reason),
  // sequences lost to unreadable pages.
  int64_t tier_bytes[kNumTiers][kNumTiers] = {};
  int64_t spills = 0;
  int64_t restores_step = 0, restores_prefetch = 0, restores_other = 0;
  int64_t data_loss = 0;
};

// A tier's size and use: its pages (slots) in all and in use, bytes per page, sequences at it.
struct TierCapacity {
  Tier tier = Tier::kHost;
  bool enabled = false;
  int64_t pages_total = 0, pages_used = 0;
  size_t bytes_per_page = 0;
  int64_t sequences = 0;
  std::string where;    // the disk tier's file
  bool direct = false;  // the disk tier's file bypasses the page cache (O_DIRECT)
};

struct DeviceCapacity {
  std::string name;         // "cpu:0"
  std::string backend;      // "cpu", "cuda"
  int32_t pages_total = 0;  // usable pages (page 0 excluded)
  int32_t pages_free = 0;
  // Of the pages in use, those only the prefix cache holds (blocks of closed sequences that a
  // request needing room takes back).
  int32_t pages_cached = 0;
  size_t bytes_per_page = 0;
  int64_t sequences = 0;
};

class LayerSource;

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  const ModelSpec& spec() const;
  // The options it was created with; cache_bytes_per_device is the size cache_fraction gave.
  const EngineOptions& options() const;
  // How the cache was sized, in words (for the startup log).
  const std::string& cache_sizing() const;
  // The CPU inner loops CPU devices run ("avx512", "avx2", "generic").
  const std::string& cpu_isa() const;
  // Which backends serve the devices: "cpu", "cuda", or both joined by "+" in device order.
  std::string backend() const;

  // ALREADY_EXISTS if the id is in use. Places the sequence on `device`, or with device < 0 on
  // the device with most free pages (ties to the lowest index).
  // import_length > 0 opens a handoff target: until write-only steps have brought it to that
  // many tokens, ordinary steps are FAILED_PRECONDITION ("being imported"), so a worker never
  // decodes on a half-copied sequence.
  // `generation`: an import's generation where it comes from (a drain keeps a failed-over
  // sequence's fencing, docs/replication.md); 1 for a new sequence, at most 2^62.
  absl::Status OpenSequence(const SequenceKey& seq, int device = -1, int64_t import_length = 0,
                            uint64_t generation = 1);
  // Opens a sequence on the longest run of `prefix`'s blocks cached in its tenant's prefix cache
  // (docs/prefix_cache.md), on `device` or (< 0) wherever they are: those pages are shared, not
  // copied, and the sequence starts that many tokens long (a step restores it first if some are
  // below the device). Returns the tokens cached (0: a new empty sequence). The sequence keeps
  // the hashes: blocks its steps commit are indexed. INVALID_ARGUMENT (more hashes than
  // max_context holds, tokens that are not the hashes' blocks), and OpenSequence's errors.
  absl::StatusOr<int64_t> OpenSequence(const SequenceKey& seq, int device, PrefixQuery prefix);
  // Standby replicas (docs/replication.md). Opens an empty standby copy at `generation`: it
  // takes write-only steps (its primary's commits, entries naming that generation) and refuses
  // every other step and forks until PromoteSequence. Charged to the standby budget
  // (RESOURCE_EXHAUSTED beyond it), not to its tenant. OpenSequence's errors.
  absl::Status OpenStandby(const SequenceKey& seq, uint64_t generation);
  // Failover: the standby copy at `generation` becomes the sequence, at generation + 1, cut back
  // to `length` when it holds more (a step its primary committed but the client never saw
  // confirmed; a shorter copy stays as it is: the client resends what it lacks). A write-only
  // step holding it (its old primary's, half sent) is aborted first. Promoting again at the
  // same generation (a retried call) returns the sequence as it is. NOT_FOUND,
  // FAILED_PRECONDITION (not a standby at that generation), DATA_LOSS.
  absl::StatusOr<SequenceInfo> PromoteSequence(const SequenceKey& seq, uint64_t generation,
                                               int64_t length);
  StandbyUsage Standby() const;
  // The leading blocks of `hashes` cached in `tenant`'s prefix cache (what an open would map),
  // touching nothing.
  PrefixLookup LookupPrefix(const std::string& tenant, const std::vector<BlockHash>& hashes) const;
  PrefixStats PrefixCacheStats() const;
  // Empties the prefix cache of every tenant (each block announced removed; pages only the
  // cache held come back); sequences keep their pages. Returns the blocks removed.
  int64_t ClearPrefixCache();
  // A new sequence holding the first `prefix_len` tokens of `parent` (a sequence of the same
  // tenant). On the parent's device
  // (device < 0 or equal) full pages are shared by reference and the partial last page is
  // copied; on another device every page is copied. NOT_FOUND (parent), ALREADY_EXISTS (id),
  // OUT_OF_RANGE (prefix_len > parent length, bad device), RESOURCE_EXHAUSTED.
  absl::Status ForkSequence(const SequenceKey& seq, const std::string& parent, int64_t prefix_len,
                            int device = -1);
  // Moves a sequence's pages to another device (rebalancing): copies every page, then drops its
  // references on the source. FAILED_PRECONDITION while in an open step; RESOURCE_EXHAUSTED if
  // the target lacks pages (nothing changes then).
  absl::Status MigrateSequence(const SequenceKey& seq, int device);
  int num_devices() const;
  // A device's name ("cpu:0", "cuda:1"), for device < num_devices().
  const std::string& device_name(int device) const;
  // Copies the committed cache rows [begin, end) of one layer of a sequence, as the cache stores
  // them (dtype = cache dtype): kv_latent [n, L], k_rope [n, R] and, on full layers, index_k
  // [n, Di] (empty otherwise). For handing a sequence to another server (export). NOT_FOUND,
  // OUT_OF_RANGE (rows beyond the committed length or a bad layer).
  using LayerRows = LayerRowBytes;
  absl::StatusOr<LayerRows> ReadRows(const SequenceKey& seq, int layer, int64_t begin,
                                     int64_t end) const;
  // The prefix-cache hashes of the blocks rows [begin, end) complete (blocks begin / page to
  // end / page), when the sequence knows them all (its prompt's, and those its steps named);
  // empty otherwise. For exports and standby copies: the blocks travel with the rows.
  absl::StatusOr<std::vector<BlockHash>> CompletedBlockHashes(const SequenceKey& seq, int64_t begin,
                                                              int64_t end) const;
  // Whether this build can drive CUDA devices (nvcc was found at build time).
  static bool CudaBuilt();
  // Every usable GPU ("cuda:0", ...) in a CUDA build with GPUs, else {"cpu:0"}; UNAVAILABLE
  // when a GPU stack is present but broken (never a silent fallback to the CPU).
  static absl::StatusOr<std::vector<std::string>> DefaultDevices();
  // FAILED_PRECONDITION while the sequence is in an open step. standby_generation nonzero:
  // only a standby copy at that generation (else FAILED_PRECONDITION, nothing closed).
  absl::Status CloseSequence(const SequenceKey& seq, uint64_t standby_generation = 0);
  absl::StatusOr<SequenceInfo> DescribeSequence(const SequenceKey& seq) const;
  // Every sequence of `tenant`, or of every tenant when `tenant` is null, sorted by (tenant, id).
  std::vector<SequenceInfo> ListSequences(const std::string* tenant) const;
  // Quotas: `fallback` for every tenant not in `overrides` (replaces limits.tenant_quota). What a
  // tenant already holds is kept; only new pages, sequences and steps are refused.
  void SetTenantQuotas(TenantQuota fallback,
                       absl::flat_hash_map<std::string, TenantQuota> overrides);
  TenantUsage TenantUsageOf(const std::string& tenant) const;
  TenantQuota TenantQuotaOf(const std::string& tenant) const;
  std::vector<DeviceCapacity> Capacity() const;
  // The host and disk tiers (enabled or not), in that order.
  std::vector<TierCapacity> Tiers() const;
  // Restores these sequences to their devices in the background (a worker about to step them)
  // and returns at once; a step on one waits for its restore instead of starting another.
  // Unknown, lost and busy ones are skipped (a step reports them).
  void PrefetchSequences(const std::vector<SequenceKey>& seqs);
  // Spills these sequences down a tier now (to the host, or the disk when the host tier is full
  // or off) and returns when they are there. NOT_FOUND (an unknown id: nothing moved),
  // FAILED_PRECONDITION (in a step, no tier below the device), RESOURCE_EXHAUSTED (every tier
  // below full), DATA_LOSS (lost); on those three the ones before the failure were moved.
  absl::Status OffloadSequences(const std::vector<SequenceKey>& seqs);
  // Spills every sequence on a device that no step began or ended on for longer than `idle`
  // (--spill-idle-ms). Returns how many moved.
  int SpillIdleSequences(std::chrono::steady_clock::duration idle);
  // Server-side absorption (docs/numerics.md): sets the weights once (checked against the model,
  // copied to every device). The same weights again: OK, nothing changes; different ones once
  // some are set: ALREADY_EXISTS (a running step never sees its weights change).
  absl::Status SetAbsorption(std::shared_ptr<const Absorption> weights);
  // The weights set, or null.
  std::shared_ptr<const Absorption> absorption() const;
  // Whether context-parallel steps are served: every device supports them and the model has no
  // sliding window.
  bool ServesContextParallel() const;
  int64_t num_sequences() const;
  int64_t num_open_steps() const;

  // Opens a step: validates the batch and reserves every page its new tokens need, or fails
  // (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE, RESOURCE_EXHAUSTED) and
  // changes nothing. Returns the step id. A sequence held by a step that is running a layer is
  // waited for (that step may be aborting: a cancel takes effect when the layer ends), up to
  // limits.abort_wait; a sequence in an idle open step is FAILED_PRECONDITION at once.
  absl::StatusOr<uint64_t> BeginStep(const std::vector<StepEntry>& batch,
                                     const StepOptions& options = {});
  // An open step's shape: total new tokens T, whether it is write-only, its next layer.
  struct StepInfo {
    int64_t tokens = 0;
    bool write_only = false;
    int next_layer = 0;
    StepPhase phase = StepPhase::kPrefill;
    std::chrono::steady_clock::time_point begun;
    // Sum over the step's queries of the keys each can see (its position + 1): no layer
    // attends more positions, so it bounds a LayerTrace before one is made.
    int64_t visible_keys = 0;
    // The same with each query's keys capped at K: what a full or shared layer attends in token
    // mode with sparse prefill.
    int64_t topk_keys = 0;
    bool context_parallel = false;
    bool attend_only = false;
  };
  // NOT_FOUND for a step never opened; for a step that ended, the status a layer of it gets:
  // CANCELLED (aborted), DEADLINE_EXCEEDED (expired), FAILED_PRECONDITION (committed).
  // Called on every layer: it copies nothing of the batch's size.
  absl::StatusOr<StepInfo> DescribeStep(const StepRef& step) const;
  // The ids of an open step's sequences, in batch order (replication's commit hook reads them at
  // a step's last layer); the same errors as DescribeStep.
  absl::StatusOr<std::vector<std::string>> StepSequenceIds(const StepRef& step) const;
  // Runs one call of layer request.layer (the step's next layer), the one entry point of the
  // layer path (engine/layer_request.h): every rule is checked against the step, then
  // sink->Prepare gets the call's LayerShape and returns where the output goes ([T, H, L] in the
  // output datatype, or [T, H, V] when the call gives q_nope and the server absorbs; no output
  // on write-only steps and candidates calls, where the sink may be null), then every device
  // computes. The last layer commits the step. Any error aborts the step, so every sequence is
  // left as before it. Modes: kAttend, or on a context-parallel step's full layers kCandidates
  // (writes the keys given and returns each query's best local candidates, absolute keys) and
  // then kSelection with every server's candidates merged (MergeCandidates); the layer advances
  // after kSelection.
  absl::StatusOr<LayerResult> RunLayer(const StepRef& step, const LayerRequest& request,
                                       LayerSink* sink);
  // The same, with the request decoded by `source` once the step is the call's: the step is
  // looked up once and the engine lock taken twice (before and after the compute), however the
  // caller decodes (the service's layer call: docs/architecture.md).
  absl::StatusOr<LayerResult> RunLayer(const StepRef& step, LayerSource& source, LayerSink* sink);
  // Aborts an open step: every sequence returns to its state before BeginStep. If a layer is
  // running, it finishes first and then reports the abort. NOT_FOUND for unknown steps.
  absl::Status AbortStep(const StepRef& step, AbortReason reason = AbortReason::kAbort);
  // Aborts steps idle for longer than `idle`; returns how many.
  int ExpireIdleSteps(std::chrono::steady_clock::duration idle);
  // Closes every sequence (of every tenant) that no step began or ended on for longer than
  // `idle` since it was opened, and that is in no open step and no copy: a crashed worker's
  // sequences give their pages back (--sequence-idle-timeout-s). Returns how many; counted in
  // EngineCounters::sequences_expired.
  int ExpireIdleSequences(std::chrono::steady_clock::duration idle);
  // Steps aborted so far, for any reason (errors, AbortStep, expiry), and steps committed.
  int64_t steps_aborted() const;
  int64_t steps_committed() const;
  EngineCounters Counters() const;

  // Introspection for tests and debugging: the reference count of every page of a device
  // (index = page id; page 0 is reserved and always 1).
  std::vector<int32_t> PageRefcounts(int device) const;
  // Waits until no prefetch is queued or running (tests and the fuzzer: what follows then does
  // not race the background restores).
  void WaitForPrefetches();
  // The sequence table's and tiers' bookkeeping agrees with itself (SequenceTable::
  // CheckInvariants; call it with no step, move or read in flight).
  absl::Status CheckInvariants() const;
  // True while no byte of the reserved page 0 was ever written, in any layer or indexer slot.
  bool ReservedPageUntouched(int device) const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A layer call before it runs: the layer it names (checked against the step's next layer under
// the lock) and its request, decoded from what the step is once the step is the call's (off the
// lock). An error from Decode aborts the step as any error of the call does.
class LayerSource {
 public:
  virtual ~LayerSource() = default;
  virtual int layer() const = 0;
  // The request stays valid until RunLayer returns.
  virtual absl::StatusOr<const LayerRequest*> Decode(const Engine::StepInfo& step) = 0;
};

}  // namespace attnd
