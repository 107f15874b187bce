#include "engine/admission.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/engine_impl.h"

namespace attnd {

int64_t CappedKeys(int64_t len, int64_t q, int64_t k) {
  const int64_t a = len + 1, b = len + q;  // the queries see a..b keys
  if (b <= k) return (a + b) * q / 2;
  if (a > k) return k * q;
  return (a + k) * (k - a + 1) / 2 + k * (b - k);
}

absl::Status CheckStepOptions(const StepOptions& options) {
  if (options.attend_only && !options.context_parallel)
    return absl::InvalidArgumentError("attend_only: a context-parallel step's option only");
  if (options.context_parallel && options.write_only)
    return absl::InvalidArgumentError(
        "context_parallel: not with write_only (an import writes a slice as any other)");
  return absl::OkStatus();
}

absl::Status CheckSlice(const ModelSpec& spec, size_t i, const std::string& id, int64_t length,
                        const StepEntry& e, bool attend_only) {
  const int64_t off = e.position_offset;
  if (off < 0 || off % spec.page_size != 0 || off > spec.max_context)
    return absl::InvalidArgumentError(absl::StrCat(
        "step batch[", i, "] (", Quote(id), "): position_offset ", off,
        " must be a multiple of the page size ", spec.page_size, " in [0, max_context]"));
  if (attend_only) {
    if (length == 0)
      return absl::InvalidArgumentError(absl::StrCat("step batch[", i, "] (", Quote(id),
                                                     "): an attend-only entry needs keys here; "
                                                     "this slice holds none"));
    if (e.query_position < off + length || e.query_position > spec.max_context - e.q_len)
      return absl::OutOfRangeError(
          absl::StrCat("step batch[", i, "] (", Quote(id), "): query_position ", e.query_position,
                       " must follow this slice's keys (", off + length, ") with q_len ", e.q_len,
                       " within max_context ", spec.max_context));
    return absl::OkStatus();
  }
  if (e.query_position != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("step batch[", i,
                     "]: query_position belongs to attend-only steps (the queries here are "
                     "the new tokens, at position_offset + length)"));
  if (e.q_len > spec.max_context - length - off)
    return absl::OutOfRangeError(absl::StrCat("sequence ", Quote(id), ": position_offset ", off,
                                              " + length ", length, " + q_len ", e.q_len,
                                              " exceeds max_context ", spec.max_context));
  return absl::OkStatus();
}

absl::Status CheckEntry(const ModelSpec& spec, const EngineLimits& limits,
                        const StepOptions& options, size_t i, const StepEntry& e,
                        const std::string& id, int64_t length, int64_t tokens_before) {
  if (e.q_len < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("step batch[", i, "] (", Quote(id), "): q_len ", e.q_len, " must be >= 1"));
  const bool cp = options.context_parallel;
  if (cp) RETURN_IF_ERROR(CheckSlice(spec, i, id, length, e, options.attend_only));
  // length <= max_context always, so the subtraction cannot overflow.
  if (!cp && e.q_len > spec.max_context - length)
    return absl::OutOfRangeError(absl::StrCat("sequence ", Quote(id), ": length ", length,
                                              " + q_len ", e.q_len, " exceeds max_context ",
                                              spec.max_context));
  if (e.q_len > limits.max_step_tokens - tokens_before)
    return absl::InvalidArgumentError(
        absl::StrCat("step batch[", i, "]: the step's tokens would exceed ", limits.max_step_tokens,
                     " (--max-step-tokens); split it into several steps"));
  return absl::OkStatus();
}

AttendedKeys EntryKeys(const ModelSpec& spec, bool attend_only, int64_t length, int64_t q_len) {
  if (attend_only)  // every query sees the slice's keys, no more
    return {q_len * length, q_len * std::min<int64_t>(length, spec.index_topk)};
  return {q_len * length + q_len * (q_len + 1) / 2, CappedKeys(length, q_len, spec.index_topk)};
}

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

absl::StatusOr<std::unique_ptr<Step>> Engine::Impl::TryBegin(const std::vector<StepEntry>& batch,
                                                             const StepOptions& options,
                                                             bool* retry, Shortfall* need_out) {
  const ModelSpec& spec = this->spec();
  auto step = std::make_unique<Step>();
  step->options = options;
  step->tenant = options.tenant;
  step->channel = options.channel;
  TenantLedger& tenants = table->tenants();
  // The open-step quota first (a tenant at it is refused at once, not after waiting for its
  // sequences), unless the batch is of standby copies (a write-only step mixes no others).
  const Sequence* first =
      batch.empty() ? nullptr : table->Find(SequenceKey(options.tenant, batch[0].sequence_id));
  if (first == nullptr || !first->standby)
    RETURN_IF_ERROR(tenants.CheckOpenSteps(options.tenant, 1));
  RETURN_IF_ERROR(CheckStepOptions(options));
  if (options.context_parallel) RETURN_IF_ERROR(ContextParallelServed());
  std::vector<int32_t> need(devices.size(), 0);
  absl::flat_hash_set<const Sequence*> seen;
  seen.reserve(batch.size());
  bool standby_batch = false;  // the entries so far are standby copies
  step->seqs.reserve(batch.size());
  // Every check before any state changes; every sum is bounded before it is formed.
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepEntry& e = batch[i];
    Sequence* seq = table->Find(SequenceKey(options.tenant, e.sequence_id));
    if (seq == nullptr)
      return absl::NotFoundError(
          absl::StrCat("step batch[", i, "]: sequence ", Quote(e.sequence_id), " not found"));
    RETURN_IF_ERROR(
        CheckEntry(spec, this->options.limits, options, i, e, seq->id, seq->length, step->tokens));
    if (!seen.insert(seq).second)
      return absl::InvalidArgumentError(
          absl::StrCat("step batch: sequence ", Quote(seq->id), " appears twice"));
    // Standby replicas (docs/replication.md): fencing, and copies that take their primary's
    // commits only.
    if (e.generation != 0 && e.generation != seq->generation)
      return absl::FailedPreconditionError(absl::StrCat(
          "step batch[", i, "]: sequence ", Quote(seq->id), " is at generation ", seq->generation,
          ", the step names ", e.generation, " (fenced: it failed over)"));
    if (e.start >= 0 && e.start != seq->length)
      return absl::FailedPreconditionError(absl::StrCat(
          "step batch[", i, "]: sequence ", Quote(seq->id), " holds ", seq->length,
          " tokens, the step starts at ", e.start, " (sent again after it was taken?)"));
    if (seq->standby && !options.write_only)
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id),
                       " is a standby copy; PromoteSequence it first (its primary failed)"));
    if (seq->standby && !options.standby_writer)
      return absl::PermissionDeniedError(
          absl::StrCat("sequence ", Quote(seq->id),
                       " is a standby copy: only its primary's replication writes it"));
    if (i > 0 && seq->standby != standby_batch)
      return absl::InvalidArgumentError(
          "step batch: a write-only step mixes standby copies and other sequences");
    standby_batch = seq->standby;
    if (options.write_only && seq->length < seq->import_length && !options.import_writer)
      return absl::PermissionDeniedError(
          absl::StrCat("sequence ", Quote(seq->id),
                       " is being imported: only the admin writes a handoff's target here"));
    if (!options.write_only && seq->length < seq->import_length)
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(seq->id), " is being imported (", seq->length, " of ",
                       seq->import_length, " tokens); retry when the handoff is complete"));
    if (seq->copying()) {
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
    // Tiers: a lost sequence is DATA_LOSS; one moving is waited for (its restore is done once,
    // however many steps wait); one below its device is restored first (BeginStep).
    if (seq->lost()) return table->OnDevice(*seq);
    if (seq->moving()) {
      *retry = true;
      return table->OnDevice(*seq);
    }
    step->tokens += e.q_len;
    const AttendedKeys keys = EntryKeys(spec, options.attend_only, seq->length, e.q_len);
    step->visible_keys += keys.visible;
    step->topk_keys += keys.topk;
    if (e.q_len != 1) step->phase = StepPhase::kPrefill;
    StepSeq s;
    s.seq = seq;
    s.q_len = e.q_len;
    s.new_len = options.attend_only ? seq->length : seq->length + e.q_len;
    s.offset = e.position_offset;
    s.query_pos = e.query_position;
    if (!e.block_hashes.empty()) {
      if (options.context_parallel)
        return absl::InvalidArgumentError(
            absl::StrCat("step batch[", i,
                         "]: block hashes on a context-parallel step (a server holds a "
                         "slice of the sequence, not its blocks from the first)"));
      RETURN_IF_ERROR(table->CheckBlockHashes(*seq, s.new_len, e.block_hashes));
      s.block_hashes = e.block_hashes;
    }
    need[seq->device] += table->PagesToGrow(*seq, s.new_len);
    // One below its device is checked like the others (its length and pages are its own
    // wherever they are), then restored first (BeginStep) once the whole batch passed.
    if (seq->tier != Tier::kDevice) {
      if (need_out != nullptr) need_out->restore.emplace_back(seq->tenant, seq->id);
      continue;
    }
    step->seqs.push_back(std::move(s));
  }
  // A step of standby copies is the replicas' work, paid for by the standby budget.
  step->counted = !standby_batch;
  int64_t need_total = 0;
  for (int32_t n : need) need_total += n;
  RETURN_IF_ERROR(standby_batch ? table->CheckStandbyPages(need_total)
                                : tenants.CheckPages(options.tenant, need_total));
  if (need_out != nullptr) need_out->checked = true;  // tier work may fix what follows
  if (need_out != nullptr && !need_out->restore.empty())
    return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(need_out->restore[0].id),
                                                      " is below its device; restoring it"));
  absl::Status full = absl::OkStatus();
  for (size_t d = 0; d < devices.size(); ++d) {
    const PagePool& pool = table->pool(d);
    // (Room counts the prefix cache's own pages, a scan: only when the free ones fall short.)
    if (need[d] <= pool.free_pages() || need[d] <= table->Room(Tier::kDevice, static_cast<int>(d)))
      continue;
    if (need_out != nullptr) {
      need_out->pages.resize(devices.size(), 0);
      need_out->pages[d] = need[d];
    }
    if (full.ok())
      full = absl::ResourceExhaustedError(
          absl::StrCat("KV cache full on ", devices[d]->name(), ": step needs ", need[d],
                       " new pages, ", pool.free_pages(), " of ", pool.usable_pages(), " free"));
  }
  RETURN_IF_ERROR(full);
  // The tables' memory before any state changes (an allocation failure changes nothing).
  for (StepSeq& s : step->seqs) {
    s.new_pages.reserve(table->PagesToGrow(*s.seq, s.new_len));
    s.table.reserve(s.seq->pages.size() + s.new_pages.capacity());
  }
  // Pages only the prefix cache holds make way (Room counted them).
  for (size_t d = 0; d < devices.size(); ++d)
    if (need[d] > 0 && !table->MakeFree(Tier::kDevice, static_cast<int>(d), need[d]))
      return absl::InternalError("the prefix cache could not give back the pages it counted");
  // Everything checked and allocated: reserve pages (cannot fail now) and bind the sequences.
  if (options.write_only) step->phase = StepPhase::kImport;
  step->id = NewStepId();
  if (step->counted) tenants.AddOpenSteps(options.tenant, 1);
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
  st.plan = StepPlan::Build(spec(), entries, st.options.write_only);
  for (const StepPlan::Share& sh : st.plan.shares) {
    ASSIGN_OR_RETURN(auto on_device, devices[sh.device]->BeginStep(sh.share));
    st.on_device.push_back(std::move(on_device));
  }
  return absl::OkStatus();
}

}  // namespace attnd
