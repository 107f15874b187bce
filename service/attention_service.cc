// AttentionService: the RPC table, the calls on sequences, shared memory, steps (begin, abort)
// and Echo and Drain. The layer call, the sharded layer, server info, the two stream reactors
// and the absorption upload live in files of their own (service_internal.h lists them).
#include "service/attention_service.h"

#include <glog/logging.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/replication_hook.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/layer_check.h"
#include "kv_store/cache_layout.h"
#include "service/layer_codec.h"
#include "service/prefix_query.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {

AttentionService::AttentionService(Engine* engine, Executor* executor, ServiceMetrics* metrics,
                                   ServiceOptions options)
    : options_(std::move(options)),
      shm_(options_.max_shm_regions, options_.shm_prefix),
      engine_(engine),
      executor_(executor),
      metrics_(metrics) {
  if (options_.data_plane != nullptr) plane_handshakes_ = std::make_unique<Executor>(2);
}

int64_t AttentionService::max_echo_bytes() const {
  return std::max<int64_t>(
      0, std::min(options_.max_echo_bytes, options_.max_message_bytes - kMessageFramingBytes));
}

int64_t AttentionService::max_attended_positions() const {
  // A position costs at most 5 bytes packed, and the reply carries the output too: a sixteenth
  // of the message limit, at most 2^24 positions (64 MiB of trace in memory).
  return std::min<int64_t>(int64_t{1} << 24, std::max<int64_t>(0, options_.max_message_bytes / 16));
}

absl::StatusOr<Caller> AttentionService::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (options_.auth == nullptr) return Caller{};
  return options_.auth->Authenticate(ctx);
}

void AttentionService::Report(const char* method, const absl::Status& status,
                              std::chrono::steady_clock::time_point started) {
  metrics_->RpcDone(
      method, status,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  step_log_.Record(method, status);
}

ShmAccess AttentionService::ShmFor(const Caller& caller) const {
  ShmAccess a{&shm_, caller.tenant, absl::OkStatus(), options_.data_plane.get()};
  if (!options_.shm_enabled) {
    a.refused = absl::PermissionDeniedError("shared memory is off on this server (--shm)");
  } else if (!caller.local) {
    a.refused = absl::PermissionDeniedError(
        "shared memory is served only over the server's Unix-socket listener (--shm-socket), "
        "to processes on its host; this call came over TCP");
  }
  return a;
}

grpc::ServerUnaryReactor* AttentionService::OpenSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::OpenSequenceRequest* req,
                                                         v1::SequenceInfo* resp) {
  // A fork may bring its parent back from a tier below the device: off gRPC's threads.
  return Posted(ctx, "OpenSequence",
                [this, req, resp](const Caller& c) { return DoOpenSequence(c, *req, resp); });
}

absl::Status AttentionService::DoOpenSequence(const Caller& caller,
                                              const v1::OpenSequenceRequest& req,
                                              v1::SequenceInfo* resp) {
  if (draining_) return Draining();
  if (req.standby_generation() != 0) return OpenStandby(caller, req, resp);
  if (req.lease_ms() != 0)
    return absl::InvalidArgumentError("lease_ms: only with standby_generation (a standby copy)");
  // A handoff's target takes another replica's keys: without --auth, an admin call.
  if (NoAuth() && (req.import_length() != 0 || req.import_generation() != 0))
    RETURN_IF_ERROR(RequireAdmin(caller, "OpenSequence",
                                 " (import_length / import_generation: a handoff's target)"));
  if (!req.fork_parent_id().empty() && (req.import_length() != 0 || req.import_generation() != 0))
    return absl::InvalidArgumentError(
        "import_length / import_generation: a fork is not a handoff target");
  if (req.fork_parent_id().empty() && req.fork_prefix_len() != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("fork_prefix_len: ", req.fork_prefix_len(), " given without fork_parent_id"));
  const bool prompt = !req.prompt_token_ids().empty() || !req.prompt_block_hashes().empty() ||
                      !req.prefix_salt().empty();
  if (prompt &&
      (!req.fork_parent_id().empty() || req.import_length() != 0 || req.import_generation() != 0))
    return absl::InvalidArgumentError(
        "prompt_token_ids / prompt_block_hashes: not with a fork or an import (a fork shares its "
        "parent's pages already; an import brings its own keys)");
  int64_t cached = 0;
  if (prompt) {
    ASSIGN_OR_RETURN(PrefixQuery q, ParsePrompt(req.prompt_token_ids(), req.prompt_block_hashes(),
                                                req.prefix_salt(), engine_->spec()));
    ASSIGN_OR_RETURN(cached,
                     engine_->OpenSequence(KeyOf(caller, req.sequence_id()), -1, std::move(q)));
  } else {
    RETURN_IF_ERROR(req.fork_parent_id().empty()
                        ? engine_->OpenSequence(KeyOf(caller, req.sequence_id()), -1,
                                                req.import_length(),
                                                std::max<uint64_t>(1, req.import_generation()))
                        : engine_->ForkSequence(KeyOf(caller, req.sequence_id()),
                                                req.fork_parent_id(), req.fork_prefix_len()));
  }
  const SequenceKey key = KeyOf(caller, req.sequence_id());
  ASSIGN_OR_RETURN(SequenceInfo info, engine_->DescribeSequence(key));
  if (replicator_ != nullptr) replicator_->Track(key, info.generation, info.length);
  FillSequence(info, *engine_, resp);
  if (replicator_ != nullptr) resp->set_standby_replica(replicator_->StandbyOf(key));
  resp->set_cached_tokens(cached);
  return absl::OkStatus();
}

absl::Status AttentionService::OpenStandby(const Caller& caller, const v1::OpenSequenceRequest& req,
                                           v1::SequenceInfo* resp) {
  // Another replica's copy: on a server with tenants, only the admin identity (the replicas'
  // peer credentials) may place one; it is charged to the standby budget, not the tenant.
  if (!IsAdmin(caller))
    return NoAuth() ? RequireAdmin(caller, "OpenSequence", " (standby_generation)")
                    : absl::PermissionDeniedError(
                          "standby_generation: only the admin identity (--admin-tenant) opens "
                          "standby copies");
  if (!req.fork_parent_id().empty() || req.fork_prefix_len() != 0 || req.import_length() != 0 ||
      req.import_generation() != 0 || !req.prompt_token_ids().empty() ||
      !req.prompt_block_hashes().empty() || !req.prefix_salt().empty())
    return absl::InvalidArgumentError(
        "standby_generation: a standby copy opens empty (no fork, import or prompt)");
  RETURN_IF_ERROR(CheckLeaseMs(caller, "lease_ms", req.lease_ms()));
  const SequenceKey key = KeyOf(caller, req.sequence_id());
  RETURN_IF_ERROR(engine_->OpenStandby(key, req.standby_generation()));
  // (A copy just opened is promoted by no one yet: the grant holds.)
  (void)leases_.Grant(key, req.lease_ms());
  ASSIGN_OR_RETURN(SequenceInfo info, engine_->DescribeSequence(key));
  FillSequence(info, *engine_, resp);
  return absl::OkStatus();
}

absl::Status AttentionService::CheckLeaseMs(const Caller& caller, const char* what,
                                            int64_t ms) const {
  if (ms == 0) return absl::OkStatus();
  if (ms < 0 || ms > StandbyLeases::kMaxLeaseMs)
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", ms, " outside [0, ", StandbyLeases::kMaxLeaseMs, "] ms"));
  if (!IsAdmin(caller))
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": only the admin identity (the replicas) holds leases"));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::PromoteSequence(grpc::CallbackServerContext* ctx,
                                                            const v1::PromoteSequenceRequest* req,
                                                            v1::SequenceInfo* resp) {
  // May wait for its old primary's replication step to abort: off gRPC's threads.
  return Posted(ctx, "PromoteSequence",
                [this, req, resp](const Caller& c) { return DoPromoteSequence(c, *req, resp); });
}

absl::Status AttentionService::DoPromoteSequence(const Caller& caller,
                                                 const v1::PromoteSequenceRequest& req,
                                                 v1::SequenceInfo* resp) {
  if (draining_) return Draining();
  const EngineLimits& lim = engine_->options().limits;
  RETURN_IF_ERROR(CheckIdLength("sequence_id", req.sequence_id(), lim.max_id_bytes));
  RETURN_IF_ERROR(CheckIdLength("failed_replica", req.failed_replica(), lim.max_id_bytes));
  if (req.generation() == 0 || req.generation() >= kMaxGeneration)
    return absl::InvalidArgumentError(absl::StrCat("generation: ", req.generation(),
                                                   " outside [1, 2^62) (SequenceInfo.generation)"));
  if (req.length() < 0 || req.length() > engine_->spec().max_context)
    return absl::OutOfRangeError(absl::StrCat("length ", req.length(), " outside [0, ",
                                              engine_->spec().max_context, "] (max_context)"));
  const SequenceKey key = KeyOf(caller, req.sequence_id());
  const auto before = engine_->DescribeSequence(key);
  // A copy whose primary may still be serving (its lease runs) is not promoted: the two would
  // both commit. The primary's own handover (a drain) ends its lease.
  // From here on its primary's calls renew nothing (BeginPromotion and Grant exclude each other).
  const bool leased_copy = before.ok() && before->standby && before->generation == req.generation();
  if (leased_copy) {
    if (const auto left = leases_.BeginPromotion(key, req.release_lease()); left.count() > 0)
      return absl::UnavailableError(absl::StrCat(
          "sequence ", Quote(key.id), ": its primary's lease on this standby copy runs ",
          left.count(),
          " ms more (it may still be serving it); promote it then (docs/replication.md#leases)"));
  }
  absl::StatusOr<SequenceInfo> promoted_info =
      engine_->PromoteSequence(key, req.generation(), req.length());
  if (leased_copy) leases_.EndPromotion(key);
  ASSIGN_OR_RETURN(SequenceInfo info, std::move(promoted_info));
  const bool promoted = before.ok() && before->standby;
  if (promoted) {
    if (metrics_ != nullptr) metrics_->Promoted();
    LOG(WARNING) << "promoted sequence " << Quote(key.id) << " (tenant " << Quote(key.tenant)
                 << ") to primary at generation " << info.generation << ", " << info.length
                 << " tokens (" << before->length << " held; the client knew " << req.length()
                 << "), failed over from "
                 << (req.failed_replica().empty() ? std::string("an unnamed replica")
                                                  : Quote(req.failed_replica()));
  }
  if (replicator_ != nullptr)
    replicator_->Track(key, info.generation, info.length, req.failed_replica());
  FillSequence(info, *engine_, resp);
  if (replicator_ != nullptr) resp->set_standby_replica(replicator_->StandbyOf(key));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::LookupPrefix(grpc::CallbackServerContext* ctx,
                                                         const v1::LookupPrefixRequest* req,
                                                         v1::LookupPrefixResponse* resp) {
  // Hashing a long prompt's tokens is work: off gRPC's threads.
  return Posted(ctx, "LookupPrefix",
                [this, req, resp](const Caller& c) { return DoLookupPrefix(c, *req, resp); });
}

absl::Status AttentionService::DoLookupPrefix(const Caller& caller,
                                              const v1::LookupPrefixRequest& req,
                                              v1::LookupPrefixResponse* resp) const {
  const ModelSpec& spec = engine_->spec();
  ASSIGN_OR_RETURN(PrefixQuery q,
                   ParsePrompt(req.token_ids(), req.block_hashes(), req.prefix_salt(), spec,
                               "token_ids", "block_hashes"));
  const PrefixLookup found = engine_->LookupPrefix(caller.tenant, q.hashes);
  resp->set_cached_blocks(found.blocks);
  resp->set_cached_tokens(found.blocks * spec.page_size);
  if (found.device >= 0) resp->set_device(engine_->device_name(found.device));
  resp->set_device_blocks(found.on_device);
  resp->set_block_size(spec.page_size);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::CloseSequence(grpc::CallbackServerContext* ctx,
                                                          const v1::CloseSequenceRequest* req,
                                                          v1::CloseSequenceResponse*) {
  // Waits for a tier move of the sequence in flight: off gRPC's threads.
  return Posted(ctx, "CloseSequence",
                [this, req](const Caller& c) { return DoCloseSequence(c, *req); });
}

absl::Status AttentionService::DoCloseSequence(const Caller& caller,
                                               const v1::CloseSequenceRequest& req) {
  // Closing a standby copy is the replicas' (their admin identity), as opening one is.
  if (req.standby_generation() != 0 && !IsAdmin(caller))
    return NoAuth() ? RequireAdmin(caller, "CloseSequence", " (standby_generation)")
                    : absl::PermissionDeniedError(
                          "standby_generation: only the admin identity (--admin-tenant) closes "
                          "standby copies");
  const SequenceKey key = KeyOf(caller, req.sequence_id());
  RETURN_IF_ERROR(engine_->CloseSequence(key, req.standby_generation()));
  leases_.Release(key);
  if (replicator_ != nullptr) replicator_->Closed(key);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::DescribeSequence(grpc::CallbackServerContext* ctx,
                                                             const v1::DescribeSequenceRequest* req,
                                                             v1::SequenceInfo* resp) {
  return Unary(ctx, "DescribeSequence",
               [&](const Caller& c) { return DoDescribeSequence(c, *req, resp); });
}

absl::Status AttentionService::DoDescribeSequence(const Caller& caller,
                                                  const v1::DescribeSequenceRequest& req,
                                                  v1::SequenceInfo* resp) {
  RETURN_IF_ERROR(CheckLeaseMs(caller, "lease_ms", req.lease_ms()));
  const SequenceKey key = KeyOf(caller, req.sequence_id());
  RETURN_IF_ERROR(FencedHere(key));  // (its copy here may still be closing)
  absl::StatusOr<SequenceInfo> info = engine_->DescribeSequence(key);
  RETURN_IF_ERROR(info.status());
  if (info->standby && !leases_.Grant(key, req.lease_ms()))  // its primary renews its lease
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(key.id), ": this standby copy is being promoted; no lease granted"));
  FillSequence(*info, *engine_, resp);
  if (replicator_ != nullptr) resp->set_standby_replica(replicator_->StandbyOf(key));
  return absl::OkStatus();
}

absl::Status AttentionService::FencedHere(const SequenceKey& key) const {
  const uint64_t g = replicator_ != nullptr ? replicator_->FencedAt(key) : 0;
  if (g == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(key.id),
                                                    " failed over to another replica (generation ",
                                                    g, "); this replica's copy was dropped"));
}

grpc::ServerUnaryReactor* AttentionService::ListSequences(grpc::CallbackServerContext* ctx,
                                                          const v1::ListSequencesRequest* req,
                                                          v1::ListSequencesResponse* resp) {
  return Unary(ctx, "ListSequences",
               [&](const Caller& c) { return DoListSequences(c, *req, resp); });
}

absl::Status AttentionService::DoListSequences(const Caller& caller,
                                               const v1::ListSequencesRequest& req,
                                               v1::ListSequencesResponse* resp) {
  if (req.all_tenants() && !caller.admin)
    return absl::PermissionDeniedError(
        "all_tenants: only the admin identity (--admin-tenant) sees other tenants' sequences");
  const auto list = engine_->ListSequences(req.all_tenants() ? nullptr : &caller.tenant);
  for (const SequenceInfo& info : list)
    FillSequence(info, *engine_, resp->add_sequences(), req.all_tenants());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::PrefetchSequences(
    grpc::CallbackServerContext* ctx, const v1::PrefetchSequencesRequest* req,
    v1::PrefetchSequencesResponse*) {
  return Unary(ctx, "PrefetchSequences",
               [&](const Caller& c) { return DoPrefetchSequences(c, *req); });
}

grpc::ServerUnaryReactor* AttentionService::OffloadSequences(grpc::CallbackServerContext* ctx,
                                                             const v1::OffloadSequencesRequest* req,
                                                             v1::OffloadSequencesResponse*) {
  return Posted(ctx, "OffloadSequences",
                [this, req](const Caller& c) { return DoOffloadSequences(c, *req); });
}

namespace {
// The ids of a prefetch or offload request, checked and in the caller's tenant.
absl::StatusOr<std::vector<SequenceKey>> Keys(
    const Caller& caller, const google::protobuf::RepeatedPtrField<std::string>& ids,
    const EngineLimits& lim) {
  if (ids.size() > lim.max_batch_entries)
    return absl::InvalidArgumentError(absl::StrCat("sequence_ids: ", ids.size(), ", at most ",
                                                   lim.max_batch_entries,
                                                   " (--max-batch-entries)"));
  std::vector<SequenceKey> keys;
  keys.reserve(ids.size());
  for (int i = 0; i < ids.size(); ++i) {
    RETURN_IF_ERROR(
        CheckIdLength(absl::StrCat("sequence_ids[", i, "]").c_str(), ids[i], lim.max_id_bytes));
    keys.push_back(KeyOf(caller, ids[i]));
  }
  return keys;
}
}  // namespace

absl::Status AttentionService::DoPrefetchSequences(const Caller& caller,
                                                   const v1::PrefetchSequencesRequest& req) {
  ASSIGN_OR_RETURN(std::vector<SequenceKey> keys,
                   Keys(caller, req.sequence_ids(), engine_->options().limits));
  engine_->PrefetchSequences(keys);
  return absl::OkStatus();
}

absl::Status AttentionService::DoOffloadSequences(const Caller& caller,
                                                  const v1::OffloadSequencesRequest& req) {
  if (draining_) return Draining();
  ASSIGN_OR_RETURN(std::vector<SequenceKey> keys,
                   Keys(caller, req.sequence_ids(), engine_->options().limits));
  return engine_->OffloadSequences(keys);
}

absl::StatusOr<uint64_t> AttentionService::Begin(const Caller& caller,
                                                 const v1::BeginStepRequest& req,
                                                 v1::BeginStepResponse* resp, uint64_t channel) {
  if (draining_) return Draining();
  const EngineLimits& lim = engine_->options().limits;
  // Bounded before anything is copied out of the request.
  if (req.batch_size() > lim.max_batch_entries)
    return absl::InvalidArgumentError(absl::StrCat("batch: ", req.batch_size(),
                                                   " entries, at most ", lim.max_batch_entries,
                                                   " (--max-batch-entries)"));
  const int shards = req.num_shards();
  const int H = engine_->spec().num_heads;
  if (shards < 0 || shards > H || (shards > 1 && (H % shards != 0 || req.write_only())))
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards: ", shards, " must divide the ", H,
                     " heads (and write-only steps are not sharded)"));
  if (req.context_parallel() && shards > 1)
    return absl::InvalidArgumentError("context_parallel: sharded steps do not take it");
  std::vector<StepEntry> batch;
  batch.reserve(req.batch_size());
  for (int i = 0; i < req.batch_size(); ++i) {
    const auto& e = req.batch(i);
    RETURN_IF_ERROR(CheckIdLength(absl::StrCat("batch[", i, "].sequence_id").c_str(),
                                  e.sequence_id(), lim.max_id_bytes));
    if (!req.context_parallel() && (e.position_offset() != 0 || e.query_position() != 0))
      return absl::InvalidArgumentError(absl::StrCat(
          "batch[", i, "]: position_offset and query_position belong to context-parallel steps"));
    batch.push_back({e.sequence_id(), e.q_len(), e.position_offset(), e.query_position()});
    batch.back().generation = e.generation();
    if (e.has_start()) {
      if (e.start() < 0)
        return absl::InvalidArgumentError(
            absl::StrCat("batch[", i, "].start: ", e.start(), " (a length, at least 0)"));
      batch.back().start = e.start();
    }
    RETURN_IF_ERROR(FencedHere(KeyOf(caller, e.sequence_id())));
    if (!e.block_hashes().empty()) {
      // At most the blocks a step of max_step_tokens can complete (the engine checks the count).
      const ModelSpec& spec = engine_->spec();
      ASSIGN_OR_RETURN(batch.back().block_hashes,
                       ParseBlockHashes(e.block_hashes(), lim.max_step_tokens / spec.page_size + 1,
                                        absl::StrCat("batch[", i, "].block_hashes")));
    }
  }
  RETURN_IF_ERROR(CheckLeaseMs(caller, "lease_ms", req.lease_ms()));
  if (req.lease_ms() != 0 && !req.write_only())
    return absl::InvalidArgumentError("lease_ms: only on write-only (replication) steps");
  StepOptions opts;
  opts.write_only = req.write_only();
  opts.context_parallel = req.context_parallel();
  opts.attend_only = req.attend_only();
  opts.tenant = caller.tenant;
  opts.standby_writer = IsAdmin(caller);
  opts.import_writer = !NoAuth() || IsAdmin(caller);
  opts.channel = shards > 1 ? 0 : channel;  // every shard's stream or call drives a sharded step
  if (replicator_ != nullptr && !req.write_only()) {
    // A sequence its standby has not acknowledged for a while may have failed over elsewhere
    // while this replica was paused or cut off: ask before serving it (docs/replication.md).
    std::vector<SequenceKey> keys;
    for (const StepEntry& e : batch) keys.push_back(KeyOf(caller, e.sequence_id));
    RETURN_IF_ERROR(replicator_->Confirm(keys, &opts.commit_by));
  }
  // A replication step renews its primary's lease on each copy, before anything is written: a
  // copy being promoted refuses it (its primary is fenced by the refusal).
  if (req.write_only())
    for (const StepEntry& e : batch)
      if (!leases_.Grant(KeyOf(caller, e.sequence_id), req.lease_ms()))
        return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(e.sequence_id),
                                                          ": this standby copy is being promoted"));
  ASSIGN_OR_RETURN(uint64_t step, engine_->BeginStep(batch, opts));
  if (shards > 1) shards_.Register(RefOf(caller, step), shards);
  int64_t tokens = 0;  // the engine bounded the sum
  for (const auto& e : batch) tokens += e.q_len;
  resp->set_step_id(step);
  resp->set_num_tokens(tokens);
  return step;
}

namespace {

// BeginStep's reactor: once gRPC is done with the call, a step whose id did not reach the client
// (the call ended cancelled: the client gave up, its deadline passed or the connection went,
// even after the executor's last look) is aborted, so it does not hold its sequences until
// --step-idle-timeout-ms. IsCancelled() is final in OnDone.
class BeginStepReactor final : public grpc::ServerUnaryReactor {
 public:
  BeginStepReactor(grpc::CallbackServerContext* ctx, std::function<void()> undelivered)
      : ctx_(ctx), undelivered_(std::move(undelivered)) {}
  // The step the reply carries (set before Finish).
  void Opened() { opened_ = true; }
  void OnDone() override {
    if (opened_ && ctx_->IsCancelled()) undelivered_();
    delete this;
  }

 private:
  grpc::CallbackServerContext* ctx_;
  std::function<void()> undelivered_;
  bool opened_ = false;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionService::BeginStep(grpc::CallbackServerContext* ctx,
                                                      const v1::BeginStepRequest* req,
                                                      v1::BeginStepResponse* resp) {
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) {
    Report("BeginStep", caller.status(), started);
    return Done(ctx, caller.status());
  }
  const absl::Status gone = absl::CancelledError(
      "BeginStep: the client cancelled or its deadline passed; no step was opened");
  // After the reply: the step is aborted on the executor (never on gRPC's thread).
  auto* reactor = new BeginStepReactor(ctx, [this, ref = RefOf(*caller, 0), resp, gone]() mutable {
    ref.id = resp->step_id();
    executor_->Post([this, ref, gone] {
      (void)engine_->AbortStep(ref);
      shards_.Fail(ref, gone);
    });
  });
  executor_->Post([this, ctx, caller = *std::move(caller), req, resp, reactor, started, gone] {
    // A client that gave up (cancelled, or its deadline passed while the step waited for its
    // sequences) never learns the step's id: the step would hold its sequences, pages and an
    // open-step slot until --step-idle-timeout-ms. It is not opened, or aborted at once, or
    // (cancelled after this last look) when the call ends (BeginStepReactor).
    absl::Status s = ctx->IsCancelled() ? gone : absl::OkStatus();
    if (s.ok()) {
      const absl::StatusOr<uint64_t> step =
          Guarded([&]() -> absl::StatusOr<uint64_t> { return Begin(caller, *req, resp); });
      s = step.status();
      if (s.ok() && ctx->IsCancelled()) {
        const StepRef ref = RefOf(caller, *step);
        (void)engine_->AbortStep(ref);
        shards_.Fail(ref, gone);
        s = gone;
      } else if (s.ok()) {
        reactor->Opened();
      }
    }
    Report("BeginStep", s, started);
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::AbortStep(grpc::CallbackServerContext* ctx,
                                                      const v1::AbortStepRequest* req,
                                                      v1::AbortStepResponse*) {
  return Unary(ctx, "AbortStep", [&](const Caller& c) { return DoAbortStep(c, *req); });
}

absl::Status AttentionService::DoAbortStep(const Caller& caller, const v1::AbortStepRequest& req) {
  const StepRef step = RefOf(caller, req.step_id());
  const absl::Status s = engine_->AbortStep(step);
  shards_.Fail(step, absl::CancelledError("step aborted by AbortStep"));
  return s;
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterSharedMemoryRequest* req,
    v1::RegisterSharedMemoryResponse*) {
  return Unary(ctx, "RegisterSharedMemory",
               [&](const Caller& c) { return DoRegisterSharedMemory(c, *req); });
}

absl::Status AttentionService::DoRegisterSharedMemory(const Caller& caller,
                                                      const v1::RegisterSharedMemoryRequest& req) {
  if (absl::Status refused = ShmFor(caller).refused; !refused.ok()) return refused;
  ASSIGN_OR_RETURN(const uid_t uid, PeerUid(caller));
  return shm_.Register(caller.tenant, req.name(), req.key(), req.offset(), req.byte_size(), uid,
                       engine_->TenantQuotaOf(caller.tenant).shm_regions);
}

absl::Status AttentionService::DoUnregisterSharedMemory(
    const Caller& caller, const v1::UnregisterSharedMemoryRequest& req) {
  if (absl::Status refused = ShmFor(caller).refused; !refused.ok()) return refused;
  return shm_.Unregister(caller.tenant, req.name());
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse*) {
  return Unary(ctx, "UnregisterSharedMemory",
               [&](const Caller& c) { return DoUnregisterSharedMemory(c, *req); });
}

bool AttentionService::NoAuth() const {
  return options_.auth == nullptr || options_.auth->options().mode == AuthMode::kNone;
}

bool AttentionService::IsAdmin(const Caller& caller) const {
  // Without --auth nobody has an identity: the admin is whoever is on this host (or presents
  // --admin-token-file's token).
  return caller.admin || (NoAuth() && (caller.local || caller.loopback));
}

absl::Status AttentionService::RequireAdmin(const Caller& caller, const char* method,
                                            const char* why) const {
  if (IsAdmin(caller)) return absl::OkStatus();
  if (NoAuth())
    return absl::PermissionDeniedError(
        absl::StrCat(method,
                     ": without --auth, admin calls are served only on loopback or the "
                     "local socket (or to the bearer of --admin-token-file)",
                     why));
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": only the admin identity (--admin-tenant)", why));
}

grpc::ServerUnaryReactor* AttentionService::Drain(grpc::CallbackServerContext* ctx,
                                                  const v1::DrainRequest* req, v1::DrainResponse*) {
  return Unary(ctx, "Drain", [&](const Caller& c) -> absl::Status {
    RETURN_IF_ERROR(RequireAdmin(c, "Drain", ""));
    if (!options_.start_drain) return absl::UnimplementedError("Drain: not served here");
    for (const std::string& peer : req->peers())
      if (std::find(options_.drain_peers.begin(), options_.drain_peers.end(), peer) ==
          options_.drain_peers.end())
        return absl::PermissionDeniedError(absl::StrCat(
            "Drain: peer ", Quote(peer), " is not among --drain-peers (",
            options_.drain_peers.empty() ? "none" : absl::StrJoin(options_.drain_peers, ","),
            "); a drain goes only to configured peers"));
    options_.start_drain(std::vector<std::string>(req->peers().begin(), req->peers().end()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::Echo(grpc::CallbackServerContext* ctx,
                                                 const v1::EchoRequest* req,
                                                 v1::EchoResponse* resp) {
  return Unary(ctx, "Echo", [&](const Caller&) { return DoEcho(*req, resp); });
}

absl::Status AttentionService::DoEcho(const v1::EchoRequest& req, v1::EchoResponse* resp) const {
  const int64_t max = max_echo_bytes();
  if (req.response_bytes() < 0 || req.response_bytes() > max)
    return absl::InvalidArgumentError(absl::StrCat("response_bytes: ", req.response_bytes(),
                                                   " outside [0, ", max,
                                                   "] (ServerInfo.limits.max_echo_bytes)"));
  resp->mutable_payload()->resize(static_cast<size_t>(req.response_bytes()));
  return absl::OkStatus();
}

}  // namespace attnd
