#include "engine/engine.h"

#include <sys/random.h>

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/client_text.h"
#include "common/enum_names.h"
#include "common/guarded.h"
#include "common/status_macros.h"
#include "engine/engine_impl.h"
#include "engine/row_reader.h"
#include "kernels/device_factory.h"

namespace attnd {
namespace {

using Clock = EngineClock;

// An unguessable step id (docs/trust.md: a stranger must not be able to name another's step).
uint64_t RandomId() {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof(v)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(&v) + got, sizeof(v) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);  // EINTR: try again
  }
  return v;
}

SequenceInfo InfoOf(const Sequence& s) {
  return SequenceInfo{s.tenant,
                      s.id,
                      s.length,
                      s.device,
                      s.pages,
                      s.step != 0,
                      s.length < s.import_length,
                      s.tier,
                      s.moving(),
                      s.lost(),
                      s.generation,
                      s.standby};
}
}  // namespace

void Engine::Impl::Release(Step* step) {
  for (StepSeq& s : step->seqs) table->Unbind(s.seq, s.new_pages, s.new_len, false);
}

std::unique_ptr<Step> Engine::Impl::Retire(Step* step) {
  if (step->counted) table->tenants().AddOpenSteps(step->tenant, -1);
  auto it = steps.find(step->id);
  std::unique_ptr<Step> out = std::move(it->second);
  steps.erase(it);
  step_ended.notify_all();
  return out;
}

std::unique_ptr<Step> Engine::Impl::AbortLocked(Step* step, absl::Status why, AbortReason reason) {
  Release(step);
  ++counters.steps_aborted[static_cast<int>(reason)];
  fates.Remember(step->id, step->tenant, std::move(why));
  return Retire(step);
}

std::unique_ptr<Step> Engine::Impl::CommitLocked(Step* step) {
  for (StepSeq& s : step->seqs)
    table->Unbind(s.seq, s.new_pages, s.new_len, true, s.block_hashes,
                  /*index=*/!step->options.context_parallel);
  ++counters.steps_committed;
  for (const StepSeq& s : step->seqs) {
    int64_t& n = step->options.write_only ? counters.tokens_import
                 : s.q_len == 1           ? counters.tokens_decode
                                          : counters.tokens_prefill;
    n += s.q_len;
  }
  fates.Remember(step->id, step->tenant,
                 absl::FailedPreconditionError(absl::StrCat(
                     "step ", step->id, " already committed at its last layer; begin a new step")));
  return Retire(step);
}

absl::StatusOr<Step*> Engine::Impl::FindStep(const StepRef& ref) const {
  EngineMutex::CountStepLookup();
  auto it = steps.find(ref.id);
  if (it != steps.end() && Owns(*it->second, ref)) return it->second.get();
  if (const absl::Status* f = fates.Find(ref.id, ref.tenant)) return *f;
  return absl::NotFoundError(absl::StrCat("step ", ref.id, " not found"));
}

uint64_t Engine::Impl::NewStepId() const {
  for (;;) {
    const uint64_t id = RandomId();
    if (id != 0 && !steps.contains(id) && !fates.Contains(id)) return id;
  }
}

absl::Status Engine::Impl::Copy(const PageMove& move) {
  const absl::Status s =
      Guarded([&] { return devices[move.from]->CopyPages(*devices[move.to], move.copies); });
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("page copy ", devices[move.from]->name(), " -> ",
                                             devices[move.to]->name(), ": ", s.message()));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  if (!impl_->prefetcher.joinable()) return;
  {
    std::lock_guard<EngineMutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->prefetch_wake.notify_all();
  impl_->prefetcher.join();
}

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
    ASSIGN_OR_RETURN(
        const CacheBudget budget,
        CacheBytesForFraction(names, options.cache_fraction, options.device.gpu_scratch_bytes));
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
  ASSIGN_OR_RETURN(impl->cpu_isa, ResolveCpuIsa(options.device.cpu_isa));
  ASSIGN_OR_RETURN(impl->devices, CreateDevices(names, options.spec, layout,
                                                DeviceOptions{impl->pool.get(), options.device}));
  RETURN_IF_ERROR(impl->CreateTiers(layout));
  const TierSlots tiers{impl->host ? impl->host->slots() : 0, impl->disk ? impl->disk->slots() : 0};
  impl->table = std::make_unique<SequenceTable>(
      names, std::vector<int32_t>(names.size(), layout.num_pages), options.spec.page_size,
      SequenceLimits{options.limits.max_id_bytes, options.limits.max_sequences}, tiers);
  impl->table->tenants().SetQuotas(options.limits.tenant_quota, {});
  impl->table->SetPrefixCache(
      options.prefix_cache_bytes < 0
          ? -1
          : options.prefix_cache_bytes / static_cast<int64_t>(layout.BytesPerPage()),
      options.on_prefix_event);
  if (options.standby_cache_bytes >= 0)
    impl->table->SetStandbyBudget(options.standby_cache_bytes /
                                  static_cast<int64_t>(layout.BytesPerPage()));
  impl->compute_ns = std::make_unique<std::atomic<int64_t>[]>(impl->devices.size());
  if (options.absorption != nullptr)
    RETURN_IF_ERROR(impl->absorption.Set(options.absorption, options.spec, impl->devices));
  Impl* raw = impl.get();
  std::unique_ptr<Engine> engine(new Engine(std::move(impl)));
  if (raw->tiers_on()) raw->prefetcher = std::thread([raw] { raw->PrefetchLoop(); });
  return engine;
}

absl::Status Engine::SetAbsorption(std::shared_ptr<const Absorption> weights) {
  return impl_->absorption.Set(std::move(weights), impl_->spec(), impl_->devices);
}

std::shared_ptr<const Absorption> Engine::absorption() const { return impl_->absorption.Get(); }

bool Engine::ServesContextParallel() const { return impl_->ContextParallelServed().ok(); }

const ModelSpec& Engine::spec() const { return impl_->spec(); }
const EngineOptions& Engine::options() const { return impl_->options; }
const std::string& Engine::cache_sizing() const { return impl_->cache_sizing; }

const std::string& Engine::cpu_isa() const { return impl_->cpu_isa; }

std::string Engine::backend() const {
  std::vector<absl::string_view> kinds;
  for (const auto& d : impl_->devices)
    if (std::find(kinds.begin(), kinds.end(), d->backend()) == kinds.end())
      kinds.push_back(d->backend());
  return absl::StrJoin(kinds, "+");
}
int Engine::num_devices() const { return static_cast<int>(impl_->devices.size()); }
const std::string& Engine::device_name(int device) const {
  return impl_->devices[device]->name();  // fixed after Create: no lock
}
absl::StatusOr<std::vector<std::string>> Engine::DefaultDevices() { return DefaultDeviceNames(); }
bool Engine::CudaBuilt() { return CudaBackendBuilt(); }

absl::Status Engine::OpenSequence(const SequenceKey& seq, int device, int64_t import_length,
                                  uint64_t generation) {
  if (import_length < 0 || import_length > impl_->spec().max_context)
    return absl::OutOfRangeError(absl::StrCat("import_length ", import_length, " outside [0, ",
                                              impl_->spec().max_context, "] (max_context)"));
  if (generation == 0 || generation > kMaxGeneration)
    return absl::InvalidArgumentError(
        absl::StrCat("import_generation: ", generation, " outside [1, 2^62]"));
  std::lock_guard<EngineMutex> lock(impl_->mu);
  RETURN_IF_ERROR(impl_->table->Open(seq, device));
  Sequence* s = impl_->table->Find(seq);
  s->import_length = import_length;
  s->generation = generation;
  return absl::OkStatus();
}

absl::Status Engine::OpenStandby(const SequenceKey& seq, uint64_t generation) {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->OpenStandby(seq, generation);
}

absl::StatusOr<SequenceInfo> Engine::PromoteSequence(const SequenceKey& seq, uint64_t generation,
                                                     int64_t length) {
  for (int attempt = 0;; ++attempt) {
    StepRef holder(0);
    {
      EngineLock lock(impl_->mu);
      impl_->AwaitSettled(lock, seq);  // a tier move of it ends first
      const Sequence* s = impl_->table->Find(seq);
      if (s == nullptr) return impl_->table->NotFound(seq);
      if (!s->standby && s->generation == generation + 1) return InfoOf(*s);  // promoted already
      auto it = s->step != 0 ? impl_->steps.find(s->step) : impl_->steps.end();
      if (it == impl_->steps.end() || !s->standby || s->generation != generation ||
          !it->second->options.write_only || attempt > 0) {
        RETURN_IF_ERROR(impl_->table->Promote(seq, generation, length));
        return InfoOf(*impl_->table->Find(seq));
      }
      holder = StepRef(it->second->tenant, it->first, it->second->channel);
    }
    // Its old primary's replication step, half sent: abort it (a running layer ends first).
    (void)AbortStep(holder, AbortReason::kAbort);
    EngineLock lock(impl_->mu);
    impl_->step_ended.wait_for(lock, impl_->options.limits.abort_wait, [&] {
      const Sequence* s = impl_->table->Find(seq);
      return s == nullptr || s->step == 0;
    });
  }
}

StandbyUsage Engine::Standby() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return {impl_->table->standby_sequences(), impl_->table->standby_pages(),
          impl_->table->standby_budget()};
}

absl::StatusOr<int64_t> Engine::OpenSequence(const SequenceKey& seq, int device,
                                             PrefixQuery prefix) {
  const ModelSpec& s = impl_->spec();
  const int64_t max_blocks = s.max_context / s.page_size;
  if (static_cast<int64_t>(prefix.hashes.size()) > max_blocks)
    return absl::InvalidArgumentError(absl::StrCat(prefix.hashes.size(), " block hashes: at most ",
                                                   max_blocks, " (max_context ", s.max_context,
                                                   " / page_size ", s.page_size, ")"));
  if (!prefix.tokens.empty() && static_cast<int64_t>(prefix.tokens.size()) !=
                                    static_cast<int64_t>(prefix.hashes.size()) * s.page_size)
    return absl::InvalidArgumentError(absl::StrCat(
        prefix.tokens.size(), " token ids for ", prefix.hashes.size(), " blocks of ", s.page_size));
  int64_t cached = 0;
  std::lock_guard<EngineMutex> lock(impl_->mu);
  RETURN_IF_ERROR(impl_->table->OpenCached(seq, device, std::move(prefix.hashes),
                                           std::move(prefix.tokens), prefix.max_blocks, &cached));
  return cached;
}

PrefixLookup Engine::LookupPrefix(const std::string& tenant,
                                  const std::vector<BlockHash>& hashes) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->LookupPrefix(tenant, hashes);
}

int64_t Engine::ClearPrefixCache() {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->ClearPrefixCache();
}

PrefixStats Engine::PrefixCacheStats() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->prefix_stats();
}

absl::Status Engine::ForkSequence(const SequenceKey& seq, const std::string& parent,
                                  int64_t prefix_len, int device) {
  PageMove move;
  {
    EngineLock lock(impl_->mu);
    const SequenceKey par(seq.tenant, parent);
    if (impl_->tiers_on() && impl_->table->Find(par) != nullptr) {
      RETURN_IF_ERROR(impl_->RestoreLocked(lock, par, TierEvent::Reason::kUse));
      const Sequence* p = impl_->table->Find(par);  // (the lock was released: look again)
      if (p == nullptr) return impl_->table->NotFound(par);
      // Room for the pages the fork copies: the partial last page, or every page across devices.
      const int to = device < 0 ? p->device : device;
      const int64_t ps = impl_->spec().page_size;
      const int32_t copies = static_cast<int32_t>(to == p->device ? (prefix_len % ps != 0)
                                                                  : (prefix_len + ps - 1) / ps);
      if (to >= 0 && to < num_devices() && prefix_len >= 0 && prefix_len <= p->length)
        RETURN_IF_ERROR(impl_->MakeRoom(lock, to, copies, {p}));
    }
    RETURN_IF_ERROR(impl_->table->BeginFork(seq, parent, prefix_len, device, &move));
  }
  const absl::Status copied = impl_->Copy(move);  // off the lock: the child is `copying`
  std::lock_guard<EngineMutex> lock(impl_->mu);
  impl_->table->EndFork(seq, move, copied.ok());
  impl_->step_ended.notify_all();
  return copied;
}

absl::Status Engine::MigrateSequence(const SequenceKey& seq, int device) {
  PageMove move;
  {
    EngineLock lock(impl_->mu);
    if (impl_->tiers_on() && impl_->table->Find(seq) != nullptr) {
      RETURN_IF_ERROR(impl_->RestoreLocked(lock, seq, TierEvent::Reason::kUse));
      const Sequence* s = impl_->table->Find(seq);  // (the lock was released: look again)
      if (s == nullptr) return impl_->table->NotFound(seq);
      if (device >= 0 && device < num_devices() && device != s->device)
        RETURN_IF_ERROR(
            impl_->MakeRoom(lock, device, static_cast<int32_t>(s->logical.size()), {s}));
    }
    RETURN_IF_ERROR(impl_->table->BeginMigrate(seq, device, &move));
  }
  const absl::Status copied = impl_->Copy(move);
  std::lock_guard<EngineMutex> lock(impl_->mu);
  impl_->table->EndMigrate(seq, move, copied.ok());
  impl_->step_ended.notify_all();
  return copied;
}

absl::Status Engine::CloseSequence(const SequenceKey& seq, uint64_t standby_generation) {
  EngineLock lock(impl_->mu);
  impl_->AwaitSettled(lock, seq);  // a move of it in flight ends first
  const Sequence* s = impl_->table->Find(seq);
  // A standby copy is replication's: closed by the replicas alone, who name its generation.
  if (s != nullptr &&
      (standby_generation == 0 ? s->standby : !s->standby || s->generation != standby_generation))
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(seq.id), " is ", s->standby ? "a standby copy" : "a primary",
        " at generation ", s->generation,
        standby_generation == 0 ? ": the replicas close it (standby_generation), not a plain close"
                                : absl::StrCat(", not a standby copy at generation ",
                                               standby_generation, ": not closed")));
  return impl_->table->Close(seq);
}

absl::StatusOr<SequenceInfo> Engine::DescribeSequence(const SequenceKey& seq) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  const Sequence* s = impl_->table->Find(seq);
  if (s == nullptr) return impl_->table->NotFound(seq);
  return InfoOf(*s);
}

std::vector<SequenceInfo> Engine::ListSequences(const std::string* tenant) const {
  std::vector<SequenceInfo> out;
  {
    std::lock_guard<EngineMutex> lock(impl_->mu);
    for (const Sequence* s : impl_->table->List(tenant)) out.push_back(InfoOf(*s));
  }
  std::sort(out.begin(), out.end(), [](const SequenceInfo& a, const SequenceInfo& b) {
    return std::tie(a.tenant, a.id) < std::tie(b.tenant, b.id);
  });
  return out;
}

void Engine::SetTenantQuotas(TenantQuota fallback,
                             absl::flat_hash_map<std::string, TenantQuota> overrides) {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  impl_->table->tenants().SetQuotas(fallback, std::move(overrides));
}

TenantUsage Engine::TenantUsageOf(const std::string& tenant) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->tenants().UsageOf(tenant);
}

TenantQuota Engine::TenantQuotaOf(const std::string& tenant) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->tenants().QuotaOf(tenant);
}

std::vector<DeviceCapacity> Engine::Capacity() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  std::vector<DeviceCapacity> out;
  for (int d = 0; d < num_devices(); ++d) {
    const PagePool& pool = impl_->table->pool(d);
    out.push_back({impl_->devices[d]->name(), std::string(impl_->devices[d]->backend()),
                   pool.usable_pages(), pool.free_pages(),
                   impl_->table->CachedOnly(Tier::kDevice, d),
                   impl_->devices[d]->layout().BytesPerPage(), impl_->table->sequences_on(d)});
  }
  return out;
}

int64_t Engine::num_sequences() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->size();
}

int64_t Engine::num_open_steps() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
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
    EngineLock lock(impl_->mu);
    const auto deadline = Clock::now() + lim.abort_wait;
    for (int rounds = 0;; ++rounds) {
      bool retry = false;
      Shortfall need;
      auto r = impl_->TryBegin(batch, options, &retry, impl_->tiers_on() ? &need : nullptr);
      if (r.ok()) {
        step = std::move(r).value();
        break;
      }
      // Tiers: bring the batch's spilled sequences to their devices and make the room its new
      // pages need by spilling others (the lock is released while bytes move), then validate
      // again: the batch is checked as a whole against what the tiers left.
      if (need.any() && rounds < 64) {
        std::vector<const Sequence*> keep;
        for (const StepEntry& e : batch)
          if (const Sequence* s = impl_->table->Find(SequenceKey(options.tenant, e.sequence_id)))
            keep.push_back(s);
        for (const SequenceKey& k : need.restore)
          RETURN_IF_ERROR(impl_->RestoreLocked(lock, k, TierEvent::Reason::kStep, keep));
        for (size_t d = 0; d < need.pages.size(); ++d)
          if (need.pages[d] > 0) RETURN_IF_ERROR(impl_->MakeRoom(lock, d, need.pages[d], keep));
        continue;
      }
      // A sequence is held by a step running a layer (it may be aborting: a client that
      // cancelled may retry at once), is being copied or is moving between tiers: wait for a
      // change, then validate again.
      if (!retry || impl_->step_ended.wait_until(lock, deadline) == std::cv_status::timeout)
        return r.status();
    }
  }
  // Bound: build the plan and the devices' step state off the lock.
  const absl::Status prepared = Guarded([&] { return impl_->Prepare(*step); });
  std::lock_guard<EngineMutex> lock(impl_->mu);
  if (!prepared.ok()) {
    impl_->Release(step.get());
    if (step->counted) impl_->table->tenants().AddOpenSteps(step->tenant, -1);
    impl_->step_ended.notify_all();
    return prepared;
  }
  step->last_used = Clock::now();
  step->begun = step->last_used;
  const uint64_t id = step->id;
  impl_->steps.emplace(id, std::move(step));
  return id;
}

absl::StatusOr<Engine::StepInfo> Engine::DescribeStep(const StepRef& step) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  return Impl::InfoOf(*st);
}

Engine::StepInfo Engine::Impl::InfoOf(const Step& st) {
  return StepInfo{st.tokens,
                  st.options.write_only,
                  st.next_layer,
                  st.phase,
                  st.begun,
                  st.visible_keys,
                  st.topk_keys,
                  st.options.context_parallel,
                  st.options.attend_only};
}

absl::StatusOr<std::vector<std::string>> Engine::StepSequenceIds(const StepRef& step) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  ASSIGN_OR_RETURN(const Step* st, impl_->FindStep(step));
  std::vector<std::string> ids;
  ids.reserve(st->seqs.size());
  for (const StepSeq& s : st->seqs) ids.push_back(s.seq->id);
  return ids;
}

absl::Status Engine::AbortStep(const StepRef& ref, AbortReason reason) {
  const uint64_t step_id = ref.id;
  std::unique_ptr<Step> ended;
  std::lock_guard<EngineMutex> lock(impl_->mu);
  EngineMutex::CountStepLookup();
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
  std::lock_guard<EngineMutex> lock(impl_->mu);
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

int Engine::ExpireIdleSequences(std::chrono::steady_clock::duration idle) {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  const auto now = Clock::now();
  std::vector<SequenceKey> expired;
  for (const Sequence* s : impl_->table->List(nullptr))
    if (s->step == 0 && !s->copying() && !s->moving() && now - s->last_used > idle)
      expired.emplace_back(s->tenant, s->id);
  int closed = 0;
  for (const SequenceKey& key : expired) closed += impl_->table->Close(key).ok() ? 1 : 0;
  impl_->counters.sequences_expired += closed;
  return closed;
}

int64_t Engine::steps_aborted() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  int64_t n = 0;
  for (int64_t a : impl_->counters.steps_aborted) n += a;
  return n;
}

EngineCounters Engine::Counters() const {
  EngineCounters c;
  {
    std::lock_guard<EngineMutex> lock(impl_->mu);
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
  static constexpr NamedValue<StepPhase> kNames[] = {{StepPhase::kPrefill, "prefill"},
                                                     {StepPhase::kDecode, "decode"},
                                                     {StepPhase::kImport, "import"}};
  return NameIn(kNames, phase);
}

int64_t Engine::steps_committed() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->counters.steps_committed;
}

std::vector<int32_t> Engine::PageRefcounts(int device) const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  const PagePool& pool = impl_->table->pool(device);
  std::vector<int32_t> out(pool.num_pages());
  for (int32_t p = 0; p < pool.num_pages(); ++p) out[p] = pool.refcount(p);
  return out;
}

absl::Status Engine::CheckInvariants() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  return impl_->table->CheckInvariants();
}

bool Engine::ReservedPageUntouched(int device) const {
  auto r = impl_->devices.at(device)->ReservedPageUntouched();
  return r.ok() && *r;
}

}  // namespace attnd
