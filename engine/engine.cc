#include "engine/engine.h"

#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <new>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/guarded.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "engine/layer_check.h"
#include "engine/row_reader.h"
#include "engine/step_fates.h"
#include "engine/step_plan.h"
#include "kernels/device_factory.h"
#include "kv_store/sequence_table.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

struct StepSeq {
  Sequence* seq = nullptr;
  int64_t q_len = 0;
  int64_t new_len = 0;
  int64_t offset = 0, query_pos = 0;  // context parallelism (StepEntry)
  std::vector<int32_t> new_pages;     // reserved by the step, owned by it until commit
  std::vector<int32_t> table;         // seq->pages + new_pages
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
  int next_layer = 0;
  bool candidates_given = false;  // context parallelism: next_layer's RunCandidates ran
  bool busy = false;
  bool abort_requested = false;
  AbortReason abort_reason = AbortReason::kAbort;  // of a requested abort
  Clock::time_point begun;
  StepPhase phase = StepPhase::kDecode;  // set once by TryBegin (DescribeStep runs per layer)
  Clock::time_point last_used;
  StepPlan plan;
  std::vector<std::unique_ptr<DeviceStep>> on_device;  // [plan.shares]
};

// Sum over positions p in [len, len + q) of min(p + 1, k): the most keys q new queries of a
// sequence of `len` tokens attend on a token-mode sparse layer.
int64_t CappedKeys(int64_t len, int64_t q, int64_t k) {
  const int64_t a = len + 1, b = len + q;  // the queries see a..b keys
  if (b <= k) return (a + b) * q / 2;
  if (a > k) return k * q;
  return (a + k) * (k - a + 1) / 2 + k * (b - k);
}

// Runs fn(i) for every i in [0, n): i > 0 on their own threads, i = 0 on this one (devices
// compute concurrently); returns the first error.
template <typename Fn>
absl::Status ForEachConcurrently(size_t n, Fn fn) {
  std::vector<std::future<absl::Status>> rest;
  for (size_t i = 1; i < n; ++i) rest.push_back(std::async(std::launch::async, fn, i));
  absl::Status status = n > 0 ? fn(size_t{0}) : absl::OkStatus();
  for (auto& f : rest) {
    const absl::Status s = f.get();
    if (status.ok()) status = s;
  }
  return status;
}

// An unguessable step id (DESIGN §11: a stranger must not be able to name another's step).
uint64_t RandomId() {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);  // EINTR: try again
  }
  return v;
}

}  // namespace

struct Engine::Impl {
  EngineOptions options;
  std::string cache_sizing;
  const ModelSpec& spec() const { return options.spec; }
  std::unique_ptr<ThreadPool> pool;
  std::vector<std::unique_ptr<Device>> devices;  // fixed after Create: read without mu

  // Server-side absorption's weights, once set (never replaced: a running step's layers all see
  // the same ones). Read under absorb_mu; set_absorb_mu serialises SetAbsorption, so a layer
  // never waits for an upload to the devices.
  std::mutex set_absorb_mu;
  mutable std::mutex absorb_mu;
  std::shared_ptr<const Absorption> absorption;
  std::shared_ptr<const Absorption> Absorbing() const {
    std::lock_guard<std::mutex> lock(absorb_mu);
    return absorption;
  }

  mutable std::mutex mu;               // guards everything below
  std::condition_variable step_ended;  // notified whenever a step ends, a layer or a copy does
  std::unique_ptr<SequenceTable> table;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Step>> steps;
  EngineCounters counters;  // device_compute_seconds kept in compute_ns below
  std::unique_ptr<std::atomic<int64_t>[]> compute_ns;  // per device, without mu
  StepFates fates;  // what a late message for an ended step is told

  // Returns an unregistered (or registered) step's pages and sequences. mu held.
  void Release(Step* step) {
    for (StepSeq& s : step->seqs) table->Unbind(s.seq, s.new_pages, s.new_len, false);
  }
  // Takes an ended step out of the table. The caller destroys it after releasing mu: freeing a
  // device's step state may wait for that device.
  std::unique_ptr<Step> Retire(Step* step) {
    table->tenants().AddOpenSteps(step->tenant, -1);
    auto it = steps.find(step->id);
    std::unique_ptr<Step> out = std::move(it->second);
    steps.erase(it);
    step_ended.notify_all();
    return out;
  }
  // `why` is what a later message for this step is told (CANCELLED or DEADLINE_EXCEEDED).
  [[nodiscard]] std::unique_ptr<Step> AbortLocked(Step* step, absl::Status why,
                                                  AbortReason reason) {
    Release(step);
    ++counters.steps_aborted[static_cast<int>(reason)];
    fates.Remember(step->id, step->tenant, std::move(why));
    return Retire(step);
  }
  [[nodiscard]] std::unique_ptr<Step> CommitLocked(Step* step) {
    for (StepSeq& s : step->seqs) table->Unbind(s.seq, s.new_pages, s.new_len, true);
    ++counters.steps_committed;
    for (const StepSeq& s : step->seqs) {
      int64_t& n = step->options.write_only ? counters.tokens_import
                   : s.q_len == 1           ? counters.tokens_decode
                                            : counters.tokens_prefill;
      n += s.q_len;
    }
    fates.Remember(
        step->id, step->tenant,
        absl::FailedPreconditionError(absl::StrCat(
            "step ", step->id, " already committed at its last layer; begin a new step")));
    return Retire(step);
  }
  // The open step `ref`, or the status its fate (or absence) gives; another tenant's step reads
  // exactly as one that does not exist. mu held.
  absl::StatusOr<Step*> FindStep(const StepRef& ref) const {
    auto it = steps.find(ref.id);
    if (it != steps.end() && Owns(*it->second, ref)) return it->second.get();
    if (const absl::Status* f = fates.Find(ref.id, ref.tenant)) return *f;
    return absl::NotFoundError(absl::StrCat("step ", ref.id, " not found"));
  }
  static bool Owns(const Step& st, const StepRef& ref) {
    return st.tenant == ref.tenant && st.channel == ref.channel;
  }
  // A fresh step id: random, never 0, never one open or remembered. mu held.
  uint64_t NewStepId() const {
    for (;;) {
      const uint64_t id = RandomId();
      if (id != 0 && !steps.contains(id) && !fates.Contains(id)) return id;
    }
  }
  // Validates a batch, reserves its pages and binds its sequences (mu held), or changes nothing.
  // *retry: a sequence is held by a step running a layer, or is being copied.
  absl::StatusOr<std::unique_ptr<Step>> TryBegin(const std::vector<StepEntry>& batch,
                                                 const StepOptions& options, bool* retry);
  // Builds the plan and each device's step state for a bound step (mu not held).
  absl::Status Prepare(Step& st);
  absl::Status Compute(Step& st, int layer, const LayerInputs& in, void* out, size_t out_bytes,
                       float* lse, LayerTrace* trace, Candidates* candidates);
  // Runs one call of `layer` on an open step (RunLayer, or RunCandidates when `candidates`):
  // the step's layer order, its busy flag, aborting it on any error; advances it unless
  // `candidates`.
  absl::Status Run(const StepRef& ref, int layer, const LayerInputs& in, void* out,
                   size_t out_bytes, LayerTrace* trace, float* lse, Candidates* candidates);
  // Context parallelism: a batch entry's slice (BeginStep), a call's shapes (either kind of
  // step), the merged selection to each share's local positions, the shares' candidates to
  // absolute ones in step order.
  absl::Status CheckSlice(size_t i, const Sequence& seq, const StepEntry& e,
                          bool attend_only) const;
  // OK when every device serves context parallelism and the model has no sliding window.
  absl::Status ContextParallelServed() const;
  absl::Status CheckShapes(const Step& st, int layer, const LayerInputs& in, size_t out_bytes,
                           bool candidates, const Absorption* absorb) const;
  absl::Status LocalSelections(const Step& st, const Candidates& sel,
                               std::vector<std::vector<std::vector<int32_t>>>* kept) const;
  absl::Status GatherCandidates(const Step& st,
                                const std::vector<std::vector<LayerCall::LocalCandidates>>& local,
                                Candidates* out) const;
  // Checks absorption weights against the model and prepares every device for them.
  absl::Status PrepareAbsorption(const Absorption& a);
  // Runs a PageMove's copies (mu not held).
  absl::Status Copy(const PageMove& move) {
    const absl::Status s =
        Guarded([&] { return devices[move.from]->CopyPages(*devices[move.to], move.copies); });
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("page copy ", devices[move.from]->name(), " -> ",
                                               devices[move.to]->name(), ": ", s.message()));
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  RETURN_IF_ERROR(ValidateModelSpec(options.spec));
  if (options.num_devices < 1) return absl::InvalidArgumentError("need at least one device");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->pool = std::make_unique<ThreadPool>(options.threads);
  std::vector<std::string> names = options.devices;
  if (names.empty())
    for (int i = 0; i < options.num_devices; ++i) names.push_back(absl::StrCat("cpu:", i));
  if (options.pages_per_device > 0) {
    impl->cache_sizing = absl::StrCat(options.pages_per_device, " pages per device (--kv-pages)");
  } else if (options.cache_fraction > 0) {
    ASSIGN_OR_RETURN(const CacheBudget budget, CacheBytesForFraction(names, options.cache_fraction,
                                                                     options.gpu_scratch_bytes));
    impl->options.cache_bytes_per_device = budget.bytes;
    impl->cache_sizing = budget.explanation;
  } else {
    impl->cache_sizing =
        absl::StrCat(options.cache_bytes_per_device, " bytes per device (--kv-cache-bytes)");
  }
  ASSIGN_OR_RETURN(
      const CacheLayout layout,
      CacheLayout::ForCapacity(options.spec, options.cache_dtype, options.pages_per_device,
                               impl->options.cache_bytes_per_device));
  const cpu::Kernels* kernels = &cpu::GetKernels(options.isa);
  ASSIGN_OR_RETURN(impl->devices, CreateDevices(names, options.spec, layout,
                                                DeviceOptions{impl->pool.get(), kernels,
                                                              options.gpu_scratch_bytes}));
  impl->table = std::make_unique<SequenceTable>(
      names, std::vector<int32_t>(names.size(), layout.num_pages), options.spec.page_size,
      SequenceLimits{options.limits.max_id_bytes, options.limits.max_sequences});
  impl->table->tenants().SetQuotas(options.limits.tenant_quota, {});
  impl->compute_ns = std::make_unique<std::atomic<int64_t>[]>(impl->devices.size());
  if (options.absorption != nullptr) {
    RETURN_IF_ERROR(impl->PrepareAbsorption(*options.absorption));
    impl->absorption = options.absorption;
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

absl::Status Engine::Impl::PrepareAbsorption(const Absorption& a) {
  const ModelSpec& s = spec();
  if (a.num_heads() != s.num_heads || a.latent_dim() != s.kv_lora_rank ||
      a.num_layers() != s.num_layers())
    return absl::InvalidArgumentError(
        absl::StrCat("absorption weights for ", a.num_layers(), " layers, ", a.num_heads(),
                     " heads, L ", a.latent_dim(), "; the model has ", s.num_layers(), " layers, ",
                     s.num_heads, " heads, L ", s.kv_lora_rank));
  if (!a.complete())
    return absl::InvalidArgumentError(
        absl::StrCat("absorption weights: layer ", a.missing_layer(), " is missing"));
  for (auto& d : devices) {
    const absl::Status p = Guarded([&] { return d->PrepareAbsorption(a); });
    if (!p.ok())
      return absl::Status(p.code(), absl::StrCat(d->name(), ": absorption weights: ", p.message()));
  }
  return absl::OkStatus();
}

absl::Status Engine::SetAbsorption(std::shared_ptr<const Absorption> weights) {
  if (weights == nullptr) return absl::InvalidArgumentError("no absorption weights");
  std::lock_guard<std::mutex> lock(impl_->set_absorb_mu);  // one upload at a time
  if (const std::shared_ptr<const Absorption> current = impl_->Absorbing()) {
    if (current->SameAs(*weights)) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat(
        "absorption weights are already loaded (", current->source(),
        ") and differ from these; they are never replaced while the server runs (restart it)"));
  }
  RETURN_IF_ERROR(impl_->PrepareAbsorption(*weights));
  std::lock_guard<std::mutex> set(impl_->absorb_mu);
  impl_->absorption = std::move(weights);
  return absl::OkStatus();
}

std::shared_ptr<const Absorption> Engine::absorption() const { return impl_->Absorbing(); }

bool Engine::ServesContextParallel() const { return impl_->ContextParallelServed().ok(); }

absl::Status Engine::Impl::ContextParallelServed() const {
  if (spec().sliding_window > 0)
    return absl::InvalidArgumentError(
        "context_parallel: not served for a model with a sliding window");
  for (const auto& d : devices)
    if (!d->SupportsContextParallel())
      return absl::UnimplementedError(
          absl::StrCat("context_parallel: ", d->name(), " does not serve it"));
  return absl::OkStatus();
}

const ModelSpec& Engine::spec() const { return impl_->spec(); }
const EngineOptions& Engine::options() const { return impl_->options; }
const std::string& Engine::cache_sizing() const { return impl_->cache_sizing; }
int Engine::num_devices() const { return static_cast<int>(impl_->devices.size()); }
absl::StatusOr<std::vector<std::string>> Engine::DefaultDevices() { return DefaultDeviceNames(); }
bool Engine::CudaBuilt() { return CudaBackendBuilt(); }

absl::Status Engine::OpenSequence(const SequenceKey& seq, int device, int64_t import_length) {
  if (import_length < 0 || import_length > impl_->spec().max_context)
    return absl::OutOfRangeError(absl::StrCat("import_length ", import_length, " outside [0, ",
                                              impl_->spec().max_context, "] (max_context)"));
  std::lock_guard<std::mutex> lock(impl_->mu);
  RETURN_IF_ERROR(impl_->table->Open(seq, device));
  impl_->table->Find(seq)->import_length = import_length;
  return absl::OkStatus();
}

absl::Status Engine::ForkSequence(const SequenceKey& seq, const std::string& parent,
                                  int64_t prefix_len, int device) {
  PageMove move;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    RETURN_IF_ERROR(impl_->table->BeginFork(seq, parent, prefix_len, device, &move));
  }
  const absl::Status copied = impl_->Copy(move);  // off the lock: the child is `copying`
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table->EndFork(seq, move, copied.ok());
  impl_->step_ended.notify_all();
  return copied;
}

absl::Status Engine::MigrateSequence(const SequenceKey& seq, int device) {
  PageMove move;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    RETURN_IF_ERROR(impl_->table->BeginMigrate(seq, device, &move));
  }
  const absl::Status copied = impl_->Copy(move);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table->EndMigrate(seq, move, copied.ok());
  impl_->step_ended.notify_all();
  return copied;
}

absl::Status Engine::CloseSequence(const SequenceKey& seq) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table->Close(seq);
}

namespace {
SequenceInfo InfoOf(const Sequence& s) {
  return SequenceInfo{
      s.tenant, s.id, s.length, s.device, s.pages, s.step != 0, s.length < s.import_length};
}
}  // namespace

absl::StatusOr<SequenceInfo> Engine::DescribeSequence(const SequenceKey& seq) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Sequence* s = impl_->table->Find(seq);
  if (s == nullptr) return impl_->table->NotFound(seq);
  return InfoOf(*s);
}

std::vector<SequenceInfo> Engine::ListSequences(const std::string* tenant) const {
  std::vector<SequenceInfo> out;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (const Sequence* s : impl_->table->List(tenant)) out.push_back(InfoOf(*s));
  }
  std::sort(out.begin(), out.end(), [](const SequenceInfo& a, const SequenceInfo& b) {
    return std::tie(a.tenant, a.id) < std::tie(b.tenant, b.id);
  });
  return out;
}

void Engine::SetTenantQuotas(TenantQuota fallback,
                             absl::flat_hash_map<std::string, TenantQuota> overrides) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table->tenants().SetQuotas(fallback, std::move(overrides));
}

TenantUsage Engine::TenantUsageOf(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table->tenants().UsageOf(tenant);
}

TenantQuota Engine::TenantQuotaOf(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table->tenants().QuotaOf(tenant);
}

absl::StatusOr<Engine::LayerRows> Engine::ReadRows(const SequenceKey& seq, int layer, int64_t begin,
                                                   int64_t end) const {
  const ModelSpec& s = impl_->spec();
  int device = 0;
  std::vector<int32_t> pages;  // the pages holding [begin, end), pinned while read
  if (layer < 0 || layer >= s.num_layers())
    return absl::OutOfRangeError(
        absl::StrCat("layer ", layer, " outside [0, ", s.num_layers(), ")"));
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    RETURN_IF_ERROR(impl_->table->PinRows(seq, begin, end, &device, &pages));
  }
  LayerRows out;
  const absl::Status read = Guarded(
      [&] { return ReadLayerRows(*impl_->devices[device], s, layer, pages, begin, end, &out); });
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table->Unpin(device, pages);
  if (!read.ok()) return read;
  return out;
}

std::vector<DeviceCapacity> Engine::Capacity() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<DeviceCapacity> out;
  for (int d = 0; d < num_devices(); ++d) {
    const PagePool& pool = impl_->table->pool(d);
    out.push_back({impl_->devices[d]->name(), pool.usable_pages(), pool.free_pages(),
                   impl_->devices[d]->layout().BytesPerPage(), impl_->table->sequences_on(d)});
  }
  return out;
}

int64_t Engine::num_sequences() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table->size();
}

int64_t Engine::num_open_steps() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->steps.size());
}

absl::StatusOr<uint64_t> Engine::BeginStep(const std::vector<StepEntry>& batch,
                                           const StepOptions& options) {
  const EngineLimits& lim = impl_->options.limits;
  if (batch.empty()) return absl::InvalidArgumentError("step batch: empty");
  if (static_cast<int64_t>(batch.size()) > lim.max_batch_entries)
    return absl::InvalidArgumentError(absl::StrCat("step batch: ", batch.size(),
                                                   " entries, at most ", lim.max_batch_entries,
                                                   " (--max-batch-entries)"));
  std::unique_ptr<Step> step;
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    const auto deadline = Clock::now() + lim.abort_wait;
    for (;;) {
      bool retry = false;
      auto r = impl_->TryBegin(batch, options, &retry);
      if (r.ok()) {
        step = std::move(r).value();
        break;
      }
      // A sequence is held by a step running a layer (it may be aborting: a client that
      // cancelled may retry at once) or is being copied: wait for a change, then validate again.
      if (!retry || impl_->step_ended.wait_until(lock, deadline) == std::cv_status::timeout)
        return r.status();
    }
  }
  // Bound: build the plan and the devices' step state off the lock.
  const absl::Status prepared = Guarded([&] { return impl_->Prepare(*step); });
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!prepared.ok()) {
    impl_->Release(step.get());
    impl_->table->tenants().AddOpenSteps(step->tenant, -1);
    impl_->step_ended.notify_all();
    return prepared;
  }
  step->last_used = Clock::now();
  step->begun = step->last_used;
  const uint64_t id = step->id;
  impl_->steps.emplace(id, std::move(step));
  return id;
}

absl::StatusOr<std::unique_ptr<Step>> Engine::Impl::TryBegin(const std::vector<StepEntry>& batch,
                                                             const StepOptions& options,
                                                             bool* retry) {
  const ModelSpec& spec = this->spec();
  const EngineLimits& lim = this->options.limits;
  auto step = std::make_unique<Step>();
  step->options = options;
  step->tenant = options.tenant;
  step->channel = options.channel;
  TenantLedger& tenants = table->tenants();
  RETURN_IF_ERROR(tenants.CheckOpenSteps(options.tenant, 1));
  const bool cp = options.context_parallel;
  if (options.attend_only && !cp)
    return absl::InvalidArgumentError("attend_only: a context-parallel step's option only");
  if (cp && options.write_only)
    return absl::InvalidArgumentError(
        "context_parallel: not with write_only (an import writes a slice as any other)");
  if (cp) RETURN_IF_ERROR(ContextParallelServed());
  std::vector<int32_t> need(devices.size(), 0);
  absl::flat_hash_set<const Sequence*> seen;
  seen.reserve(batch.size());
  step->seqs.reserve(batch.size());
  // Every check before any state changes; every sum is bounded before it is formed.
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepEntry& e = batch[i];
    Sequence* seq = table->Find(SequenceKey(options.tenant, e.sequence_id));
    if (seq == nullptr)
      return absl::NotFoundError(
          absl::StrCat("step batch[", i, "]: sequence ", Quote(e.sequence_id), " not found"));
    if (e.q_len < 1)
      return absl::InvalidArgumentError(absl::StrCat("step batch[", i, "] (", Quote(seq->id),
                                                     "): q_len ", e.q_len, " must be >= 1"));
    if (cp) RETURN_IF_ERROR(CheckSlice(i, *seq, e, options.attend_only));
    // seq->length <= max_context always, so the subtraction cannot overflow.
    if (!cp && e.q_len > spec.max_context - seq->length)
      return absl::OutOfRangeError(absl::StrCat("sequence ", Quote(seq->id), ": length ",
                                                seq->length, " + q_len ", e.q_len,
                                                " exceeds max_context ", spec.max_context));
    if (e.q_len > lim.max_step_tokens - step->tokens)
      return absl::InvalidArgumentError(
          absl::StrCat("step batch[", i, "]: the step's tokens would exceed ", lim.max_step_tokens,
                       " (--max-step-tokens); split it into several steps"));
    if (!seen.insert(seq).second)
      return absl::InvalidArgumentError(
          absl::StrCat("step batch: sequence ", Quote(seq->id), " appears twice"));
    if (!options.write_only && seq->length < seq->import_length)
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id), " is being imported (", seq->length, " of ",
                       seq->import_length, " tokens); retry when the handoff is complete"));
    if (seq->copying) {
      *retry = true;
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id), " is being copied (fork or migration); retry"));
    }
    if (seq->step != 0) {
      auto other = steps.find(seq->step);
      // A step running a layer may be about to abort (its client cancelled, and the cancel
      // reaches the engine only when the layer ends): wait for that layer, then look again.
      *retry = other != steps.end() && (other->second->abort_requested || other->second->busy);
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id), " is already in open step ", seq->step));
    }
    step->tokens += e.q_len;
    if (options.attend_only) {  // every query sees the slice's keys, no more
      step->visible_keys += e.q_len * seq->length;
      step->topk_keys += e.q_len * std::min<int64_t>(seq->length, spec.index_topk);
    } else {
      step->visible_keys += e.q_len * seq->length + e.q_len * (e.q_len + 1) / 2;
      step->topk_keys += CappedKeys(seq->length, e.q_len, spec.index_topk);
    }
    if (e.q_len != 1) step->phase = StepPhase::kPrefill;
    StepSeq s;
    s.seq = seq;
    s.q_len = e.q_len;
    s.new_len = options.attend_only ? seq->length : seq->length + e.q_len;
    s.offset = e.position_offset;
    s.query_pos = e.query_position;
    need[seq->device] += table->PagesToGrow(*seq, s.new_len);
    step->seqs.push_back(std::move(s));
  }
  int64_t need_total = 0;
  for (int32_t n : need) need_total += n;
  RETURN_IF_ERROR(tenants.CheckPages(options.tenant, need_total));
  for (size_t d = 0; d < devices.size(); ++d) {
    const PagePool& pool = table->pool(d);
    if (need[d] > pool.free_pages())
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache full on ", devices[d]->name(), ": step needs ", need[d],
                       " new pages, ", pool.free_pages(), " of ", pool.usable_pages(), " free"));
  }
  // The tables' memory before any state changes (an allocation failure changes nothing).
  for (StepSeq& s : step->seqs) {
    s.new_pages.reserve(table->PagesToGrow(*s.seq, s.new_len));
    s.table.reserve(s.seq->pages.size() + s.new_pages.capacity());
  }
  // Everything checked and allocated: reserve pages (cannot fail now) and bind the sequences.
  if (options.write_only) step->phase = StepPhase::kImport;
  step->id = NewStepId();
  tenants.AddOpenSteps(options.tenant, 1);
  for (StepSeq& s : step->seqs) {
    table->Bind(s.seq, step->id, s.new_len, &s.new_pages);
    s.table = s.seq->pages;
    s.table.insert(s.table.end(), s.new_pages.begin(), s.new_pages.end());
  }
  return step;
}

absl::Status Engine::Impl::Prepare(Step& st) {
  std::vector<PlanEntry> entries;
  entries.reserve(st.seqs.size());
  const bool attend_only = st.options.attend_only;
  for (const StepSeq& s : st.seqs) {
    PlanEntry e{s.seq->device, attend_only ? s.new_len : s.new_len - s.q_len, s.q_len, &s.table};
    e.context_parallel = st.options.context_parallel;
    e.offset = s.offset;
    e.attend_only = attend_only;
    e.query_pos = s.query_pos;
    entries.push_back(e);
  }
  st.plan = StepPlan::Build(spec(), entries);
  for (const StepPlan::Share& sh : st.plan.shares) {
    ASSIGN_OR_RETURN(auto on_device, devices[sh.device]->BeginStep(sh.share));
    st.on_device.push_back(std::move(on_device));
  }
  return absl::OkStatus();
}

absl::StatusOr<Engine::StepInfo> Engine::DescribeStep(const StepRef& step) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  return StepInfo{st->tokens,
                  st->options.write_only,
                  st->next_layer,
                  st->phase,
                  st->begun,
                  st->visible_keys,
                  st->topk_keys,
                  st->options.context_parallel,
                  st->options.attend_only};
}

absl::Status Engine::CheckLayer(const StepRef& step, int layer, const LayerInputs& in,
                                size_t out_bytes, bool candidates) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  if (layer != st->next_layer)
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step.id, ": layer ", layer, " out of order, expected layer ", st->next_layer));
  return impl_->CheckShapes(*st, layer, in, out_bytes, candidates, impl_->Absorbing().get());
}

absl::Status Engine::Impl::CheckSlice(size_t i, const Sequence& seq, const StepEntry& e,
                                      bool attend_only) const {
  const ModelSpec& spec = this->spec();
  const int64_t off = e.position_offset;
  if (off < 0 || off % spec.page_size != 0 || off > spec.max_context)
    return absl::InvalidArgumentError(absl::StrCat(
        "step batch[", i, "] (", Quote(seq.id), "): position_offset ", off,
        " must be a multiple of the page size ", spec.page_size, " in [0, max_context]"));
  if (attend_only) {
    if (seq.length == 0)
      return absl::InvalidArgumentError(absl::StrCat("step batch[", i, "] (", Quote(seq.id),
                                                     "): an attend-only entry needs keys here; "
                                                     "this slice holds none"));
    if (e.query_position < off + seq.length || e.query_position > spec.max_context - e.q_len)
      return absl::OutOfRangeError(
          absl::StrCat("step batch[", i, "] (", Quote(seq.id), "): query_position ",
                       e.query_position, " must follow this slice's keys (", off + seq.length,
                       ") with q_len ", e.q_len, " within max_context ", spec.max_context));
    return absl::OkStatus();
  }
  if (e.query_position != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("step batch[", i,
                     "]: query_position belongs to attend-only steps (the queries here are "
                     "the new tokens, at position_offset + length)"));
  if (e.q_len > spec.max_context - seq.length - off)
    return absl::OutOfRangeError(absl::StrCat("sequence ", Quote(seq.id), ": position_offset ", off,
                                              " + length ", seq.length, " + q_len ", e.q_len,
                                              " exceeds max_context ", spec.max_context));
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckShapes(const Step& st, int layer, const LayerInputs& in,
                                       size_t out_bytes, bool candidates,
                                       const Absorption* absorb) const {
  const ModelSpec& s = spec();
  if (!st.options.context_parallel) {
    if (candidates)
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", st.id, ": candidates belong to context-parallel steps (a full layer there)"));
    return CheckLayerShapes(s, options.cache_dtype, st.tokens, st.options.write_only, layer, in,
                            out_bytes, absorb);
  }
  const bool full = layer >= 0 && layer < s.num_layers() && s.layers[layer] == LayerKind::kFull;
  if (candidates && !full)
    return absl::InvalidArgumentError(absl::StrCat("candidates: layer ", layer, " is a ",
                                                   LayerKindName(s.layers[layer]),
                                                   " layer; only full layers select"));
  if (full && candidates == st.candidates_given)
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", st.id, ": layer ", layer,
        candidates ? ": its candidates were given already; send the selection and the queries"
                   : ": a context-parallel full layer first gives its candidates (RunCandidates)"));
  const CpMessage m = !full        ? CpMessage::kLayer
                      : candidates ? CpMessage::kCandidates
                                   : CpMessage::kSelection;
  return CheckContextParallelShapes(s, options.cache_dtype, st.tokens, layer, m,
                                    st.options.attend_only, in, out_bytes, absorb);
}

absl::Status Engine::Impl::Compute(Step& st, int layer, const LayerInputs& in, void* out,
                                   size_t out_bytes, float* lse, LayerTrace* trace,
                                   Candidates* candidates) {
  const ModelSpec& s = spec();
  const bool write_only = st.options.write_only;
  const std::shared_ptr<const Absorption> absorb = Absorbing();  // held until the layer ends
  RETURN_IF_ERROR(CheckShapes(st, layer, in, out_bytes, candidates != nullptr, absorb.get()));
  if (candidates != nullptr && (lse != nullptr || trace != nullptr))
    return absl::InvalidArgumentError("candidates call: it attends nothing (no lse, no trace)");
  if (write_only && lse != nullptr)
    return absl::InvalidArgumentError("a write-only step has no attention, so no log-sum-exp");
  if (options.limits.check_finite) RETURN_IF_ERROR(CheckLayerFinite(in));
  RETURN_IF_ERROR(CheckFp8Scales(in));
  const LayerKind kind = s.layers[layer];
  LayerCall call;
  call.layer = layer;
  call.in = &in;
  call.select = kind == LayerKind::kFull;  // IndexShare: other sparse layers reuse it
  call.out_dtype = write_only ? DType::kBF16 : OutputDType(in);
  call.out = write_only ? nullptr : static_cast<uint8_t*>(out);
  call.lse = lse;
  if (in.q_nope.present) call.absorb = absorb.get();
  if (candidates != nullptr) call.out = nullptr;
  // Context parallelism: each share's local candidates, or its part of the merged selection.
  const size_t num_shares = st.plan.shares.size();
  std::vector<std::vector<LayerCall::LocalCandidates>> local(candidates ? num_shares : 0);
  std::vector<std::vector<std::vector<int32_t>>> kept(in.selection ? num_shares : 0);
  if (in.selection != nullptr) RETURN_IF_ERROR(LocalSelections(st, *in.selection, &kept));
  RETURN_IF_ERROR(ForEachConcurrently(num_shares, [&](size_t i) {
    const StepPlan::Share& sh = st.plan.shares[i];
    LayerCall mine = call;
    if (candidates != nullptr) {
      local[i].assign(sh.share.size(), {});
      mine.candidates = &local[i];
    }
    if (in.selection != nullptr) mine.selection = &kept[i];
    const auto t0 = Clock::now();
    absl::Status s = devices[sh.device]->RunLayer(sh.share, *st.on_device[i], mine);
    compute_ns[sh.device] +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    return s;
  }));
  if (candidates != nullptr) return GatherCandidates(st, local, candidates);
  if (trace == nullptr) return absl::OkStatus();
  trace->keys.assign(st.tokens, {});
  if (write_only) return absl::OkStatus();
  for (size_t i = 0; i < st.plan.shares.size(); ++i) {
    const StepShare& share = st.plan.shares[i].share;
    std::vector<std::vector<int32_t>> selected;
    if (kind != LayerKind::kDense)
      RETURN_IF_ERROR(
          devices[st.plan.shares[i].device]->SelectedPositions(share, *st.on_device[i], &selected));
    TraceAttended(s, kind, share, &selected, &trace->keys);
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::Run(const StepRef& ref, int layer, const LayerInputs& in, void* out,
                               size_t out_bytes, LayerTrace* trace, float* lse,
                               Candidates* candidates) {
  const uint64_t step_id = ref.id;
  std::unique_ptr<Step> ended;  // destroyed after the lock is released
  Step* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSIGN_OR_RETURN(st, FindStep(ref));
    if (st->busy) {
      st->abort_requested = true;  // every error aborts the step: the running layer does it
      st->abort_reason = AbortReason::kError;
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": a layer is already running; step aborted"));
    }
    if (layer != st->next_layer) {
      const absl::Status why = absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": layer ", layer, " out of order, expected layer ",
                       st->next_layer, "; step aborted"));
      ended = AbortLocked(
          st, absl::CancelledError(absl::StrCat("step ", step_id, " was aborted: ", why.message())),
          AbortReason::kError);
      return why;
    }
    st->busy = true;
  }
  absl::Status status;
  try {
    status = Compute(*st, layer, in, out, out_bytes, lse, trace, candidates);
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("step ", step_id, " layer ", layer, ": out of host memory; step aborted"));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("step ", step_id, " layer ", layer, ": ", e.what()));
  }
  std::lock_guard<std::mutex> lock(mu);
  st->busy = false;
  st->last_used = Clock::now();
  if (!status.ok() || st->abort_requested) {
    const absl::Status fate =
        status.ok() ? absl::CancelledError(absl::StrCat("step ", step_id, " was aborted"))
                    : absl::CancelledError(absl::StrCat(
                          "step ", step_id, " was aborted after an error: ", status.message()));
    ended = AbortLocked(st, fate, status.ok() ? st->abort_reason : AbortReason::kError);
    return status.ok() ? fate : status;
  }
  if (candidates != nullptr) {  // the same layer runs next, with the merged selection
    st->candidates_given = true;
    step_ended.notify_all();
    return absl::OkStatus();
  }
  st->candidates_given = false;
  if (++st->next_layer == spec().num_layers()) {
    ended = CommitLocked(st);
  } else {
    step_ended.notify_all();  // BeginStep may wait for this layer (see TryBegin)
  }
  return absl::OkStatus();
}

absl::Status Engine::RunLayer(const StepRef& ref, int layer, const LayerInputs& in, void* out,
                              size_t out_bytes, LayerTrace* trace, float* lse) {
  return impl_->Run(ref, layer, in, out, out_bytes, trace, lse, nullptr);
}

absl::Status Engine::RunCandidates(const StepRef& ref, int layer, const LayerInputs& in,
                                   Candidates* out) {
  if (out == nullptr) return absl::InvalidArgumentError("RunCandidates: no output");
  return impl_->Run(ref, layer, in, nullptr, 0, nullptr, nullptr, out);
}

absl::Status Engine::Impl::LocalSelections(
    const Step& st, const Candidates& sel,
    std::vector<std::vector<std::vector<int32_t>>>* kept) const {
  std::vector<int64_t> query_pos(st.tokens);
  std::vector<uint8_t> needs(st.tokens);
  for (const StepPlan::Share& sh : st.plan.shares)
    for (int64_t i = 0; i < sh.share.size(); ++i) {
      query_pos[sh.share.rows[i]] = sh.share.query_pos[i];
      needs[sh.share.rows[i]] = sh.share.needs_index[i];
    }
  RETURN_IF_ERROR(CheckSelection(spec(), query_pos, needs, sel));
  std::vector<int64_t> first(st.tokens + 1, 0);
  for (int64_t t = 0; t < st.tokens; ++t) first[t + 1] = first[t] + sel.count[t];
  for (size_t k = 0; k < st.plan.shares.size(); ++k) {
    const StepShare& sh = st.plan.shares[k].share;
    auto& mine = (*kept)[k];
    mine.assign(sh.size(), {});
    for (int64_t i = 0; i < sh.size(); ++i) {
      if (!sh.needs_index[i]) continue;
      const int64_t t = sh.rows[i];
      LocalSelection(spec(), sel.count[t], sel.keys.data() + first[t], sel.scores.data() + first[t],
                     sh.query_pos[i], sh.offset[i], sh.pos[i] + 1, &mine[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::GatherCandidates(
    const Step& st, const std::vector<std::vector<LayerCall::LocalCandidates>>& local,
    Candidates* out) const {
  const ModelSpec& s = spec();
  std::vector<const LayerCall::LocalCandidates*> by_row(st.tokens, nullptr);
  std::vector<int64_t> shift(st.tokens, 0);
  const bool pages = s.selection == SelectionMode::kPageBudget;
  for (size_t k = 0; k < st.plan.shares.size(); ++k) {
    const StepShare& sh = st.plan.shares[k].share;
    for (int64_t i = 0; i < sh.size(); ++i) {
      by_row[sh.rows[i]] = &local[k][i];
      shift[sh.rows[i]] = pages ? sh.offset[i] / s.page_size : sh.offset[i];
    }
  }
  Candidates c;
  c.pages = pages;
  c.keep = CandidatesPerQuery(s);
  for (int64_t t = 0; t < st.tokens; ++t) {
    const LayerCall::LocalCandidates& l = *by_row[t];
    c.count.push_back(static_cast<int32_t>(l.keys.size()));
    for (size_t j = 0; j < l.keys.size(); ++j) {
      c.keys.push_back(l.keys[j] + shift[t]);
      c.scores.push_back(l.scores[j]);
    }
  }
  *out = std::move(c);
  return absl::OkStatus();
}

absl::Status Engine::AbortStep(const StepRef& ref, AbortReason reason) {
  const uint64_t step_id = ref.id;
  std::unique_ptr<Step> ended;
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->steps.find(step_id);
  if (it == impl_->steps.end() || !Impl::Owns(*it->second, ref))
    return absl::NotFoundError(absl::StrCat("step ", step_id, " not found"));
  if (it->second->busy) {
    it->second->abort_requested = true;  // the running layer aborts it when done
    it->second->abort_reason = reason;
  } else {
    ended = impl_->AbortLocked(it->second.get(),
                               absl::CancelledError(absl::StrCat("step ", step_id, " was aborted")),
                               reason);
  }
  return absl::OkStatus();
}

int Engine::ExpireIdleSteps(std::chrono::steady_clock::duration idle) {
  std::vector<std::unique_ptr<Step>> ended;
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto now = Clock::now();
  std::vector<Step*> expired;
  for (auto& [id, st] : impl_->steps)
    if (!st->busy && now - st->last_used > idle) expired.push_back(st.get());
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(idle).count();
  for (Step* st : expired)
    ended.push_back(impl_->AbortLocked(
        st,
        absl::DeadlineExceededError(absl::StrCat("step ", st->id, " expired: idle longer than ", ms,
                                                 " ms; its sequences are as before it")),
        AbortReason::kExpiry));
  return static_cast<int>(expired.size());
}

int64_t Engine::steps_aborted() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int64_t n = 0;
  for (int64_t a : impl_->counters.steps_aborted) n += a;
  return n;
}

EngineCounters Engine::Counters() const {
  EngineCounters c;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    c = impl_->counters;
  }
  for (int d = 0; d < num_devices(); ++d)
    c.device_compute_seconds.push_back(static_cast<double>(impl_->compute_ns[d].load()) * 1e-9);
  return c;
}

const char* AbortReasonName(AbortReason reason) {
  static constexpr const char* kNames[kNumAbortReasons] = {"error", "abort", "cancel", "expiry",
                                                           "drain"};
  return kNames[static_cast<int>(reason)];
}

const char* StepPhaseName(StepPhase phase) {
  switch (phase) {
    case StepPhase::kPrefill:
      return "prefill";
    case StepPhase::kDecode:
      return "decode";
    case StepPhase::kImport:
      return "import";
  }
  return "?";
}

int64_t Engine::steps_committed() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->counters.steps_committed;
}

std::vector<int32_t> Engine::PageRefcounts(int device) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const PagePool& pool = impl_->table->pool(device);
  std::vector<int32_t> out(pool.num_pages());
  for (int32_t p = 0; p < pool.num_pages(); ++p) out[p] = pool.refcount(p);
  return out;
}

bool Engine::ReservedPageUntouched(int device) const {
  auto r = impl_->devices.at(device)->ReservedPageUntouched();
  return r.ok() && *r;
}

}  // namespace attnd
