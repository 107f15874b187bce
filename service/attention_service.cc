#include "service/attention_service.h"

#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/layer_check.h"
#include "kv_store/cache_layout.h"
#include "service/export_chunk.h"
#include "service/layer_codec.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {
namespace {

void FillSequence(const SequenceInfo& s, const Engine& e, v1::SequenceInfo* out,
                  bool with_tenant = false) {
  out->set_sequence_id(s.id);
  if (with_tenant) out->set_tenant(s.tenant);
  out->set_length(s.length);
  out->set_device(e.Capacity()[s.device].name);
  out->set_num_pages(static_cast<int32_t>(s.pages.size()));
  out->set_in_step(s.in_step);
  out->set_importing(s.importing);
}

absl::Status Draining() {
  return absl::UnavailableError("attnd is draining: no new sequences or steps; retry elsewhere");
}

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

// A client-supplied sequence id longer than the server allows cannot name a sequence: refuse it
// before it is copied anywhere.
absl::Status CheckIdLength(const char* field, const std::string& id, size_t max) {
  if (id.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", id.size(), " bytes, longer than ", max, " (--max-id-bytes)"));
}

// An output that could not be written to its region after the layer ran (only an I/O error can
// do that). After the last layer the step has committed, and the error says so.
absl::Status OutputWriteError(uint64_t step, bool committed, const absl::Status& w) {
  if (!committed) return w;
  return absl::DataLossError(absl::StrCat(
      "step ", step, " committed, but its output could not be written to out_shm: ", w.message()));
}

StepRef RefOf(const Caller& c, uint64_t step, uint64_t channel = 0) {
  return StepRef(c.tenant, step, channel);
}

SequenceKey KeyOf(const Caller& c, const std::string& id) { return SequenceKey(c.tenant, id); }

// The user of the process at the other end of a Unix-socket connection.
absl::StatusOr<uid_t> PeerUid(const Caller& c) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  int domain = 0;
  socklen_t dlen = sizeof(domain);
  if (!c.local || getsockopt(c.socket_fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) != 0 ||
      domain != AF_UNIX || getsockopt(c.socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return absl::PermissionDeniedError("shared memory: the caller's user is unknown");
  return cred.uid;
}

}  // namespace

AttentionService::AttentionService(Engine* engine, Executor* executor, ServiceMetrics* metrics,
                                   ServiceOptions options)
    : options_(std::move(options)),
      shm_(options_.max_shm_regions, options_.shm_prefix),
      engine_(engine),
      executor_(executor),
      metrics_(metrics) {}

int64_t AttentionService::max_echo_bytes() const {
  return std::max<int64_t>(
      0, std::min(options_.max_echo_bytes, options_.max_message_bytes - kMessageFramingBytes));
}

int64_t AttentionService::max_attended_positions() const {
  // A position costs at most 5 bytes packed, and the reply carries the output too: a sixteenth
  // of the message limit, at most 2^24 positions (64 MiB of trace in memory).
  return std::min<int64_t>(int64_t{1} << 24, std::max<int64_t>(0, options_.max_message_bytes / 16));
}

int64_t AttentionService::max_export_chunk_tokens() const {
  const CacheLayout c = CacheLayout::ForModel(engine_->spec(), engine_->options().cache_dtype, 0);
  // A chunk carries each token's cached bytes (fp8: its scales too).
  const int64_t per_token = static_cast<int64_t>(c.latent_row_bytes() + c.index_row_bytes());
  return std::max<int64_t>(1, (options_.max_message_bytes - kMessageFramingBytes) / per_token);
}

absl::StatusOr<Caller> AttentionService::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (options_.auth == nullptr) return Caller{};
  return options_.auth->Authenticate(ctx);
}

template <typename Fn>
grpc::ServerUnaryReactor* AttentionService::Unary(grpc::CallbackServerContext* ctx,
                                                  const char* method, Fn fn) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  const absl::Status s = caller.ok() ? Guarded([&] { return fn(*caller); }) : caller.status();
  Report(method, s);
  return Done(ctx, s);
}

void AttentionService::Report(const char* method, const absl::Status& status) {
  metrics_->RpcDone(method, status);
  step_log_.Record(method, status);
}

ShmAccess AttentionService::ShmFor(const Caller& caller) const {
  ShmAccess a{&shm_, caller.tenant, absl::OkStatus()};
  if (!options_.shm_enabled) {
    a.refused = absl::PermissionDeniedError("shared memory is off on this server (--shm)");
  } else if (!caller.local) {
    a.refused = absl::PermissionDeniedError(
        "shared memory is served only over the server's Unix-socket listener (--shm-socket), "
        "to processes on its host; this call came over TCP");
  }
  return a;
}

grpc::ServerUnaryReactor* AttentionService::ServerInfo(grpc::CallbackServerContext* ctx,
                                                       const v1::ServerInfoRequest*,
                                                       v1::ServerInfoResponse* resp) {
  return Unary(ctx, "ServerInfo", [&](const Caller& c) { return DoServerInfo(c, resp); });
}

absl::Status AttentionService::DoServerInfo(const Caller& caller,
                                            v1::ServerInfoResponse* resp) const {
  const ModelSpec& s = engine_->spec();
  resp->set_version(absl::StrCat("attnd ", BuildVersion(), " (", BuildRevision(), ")"));
  resp->set_tenant(caller.tenant);
  resp->set_admin(caller.admin);
  resp->set_auth(options_.auth ? AuthModeName(options_.auth->options().mode) : "none");
  resp->set_shm(options_.shm_enabled);
  resp->set_context_parallel(engine_->ServesContextParallel());
  if (const std::shared_ptr<const Absorption> a = engine_->absorption()) {
    v1::AbsorptionInfo* ai = resp->mutable_absorption();
    ai->set_qk_nope_head_dim(a->qk_nope_head_dim());
    ai->set_v_head_dim(a->v_head_dim());
    ai->set_source(a->source());
    ai->set_bytes(static_cast<int64_t>(a->bytes()));
  }
  v1::ModelSpec* m = resp->mutable_model();
  m->set_name(s.name);
  for (LayerKind k : s.layers) m->add_layers(std::string(LayerKindName(k)));
  m->set_kv_lora_rank(s.kv_lora_rank);
  m->set_qk_rope_head_dim(s.qk_rope_head_dim);
  m->set_num_heads(s.num_heads);
  m->set_index_n_heads(s.index_n_heads);
  m->set_index_head_dim(s.index_head_dim);
  m->set_index_topk(s.index_topk);
  m->set_page_size(s.page_size);
  m->set_sm_scale(s.sm_scale);
  m->set_max_context(s.max_context);
  m->set_selection(SelectionModeName(s));
  m->set_page_union_max_pages(s.page_union_max_pages);
  m->set_prefill(std::string(PrefillModeName(s.prefill)));
  m->set_sliding_window(s.sliding_window);
  m->set_soft_cap(s.soft_cap);
  resp->set_backend(options_.backend);
  resp->set_cpu_isa(std::string(cpu::IsaName(engine_->options().isa)));
  resp->set_cache_datatype(std::string(DTypeName(engine_->options().cache_dtype)));
  for (const DeviceCapacity& d : engine_->Capacity()) {
    v1::DeviceInfo* out = resp->add_devices();
    out->set_name(d.name);
    out->set_pages_total(d.pages_total);
    out->set_pages_free(d.pages_free);
    out->set_bytes_per_page(static_cast<int64_t>(d.bytes_per_page));
    out->set_sequences(d.sequences);
  }
  for (const char* t : {"BF16", "FP16", "FP32"}) resp->add_datatypes(t);
  resp->add_datatypes("FP8_E4M3");  // queries with scales anywhere; keys into an fp8 cache
  resp->set_max_message_bytes(options_.max_message_bytes);
  resp->set_step_idle_timeout_ms(options_.step_idle_timeout_ms);
  const EngineLimits& lim = engine_->options().limits;
  v1::ServerLimits* l = resp->mutable_limits();
  l->set_max_echo_bytes(max_echo_bytes());
  l->set_max_export_chunk_tokens(max_export_chunk_tokens());
  l->set_max_attended_positions(max_attended_positions());
  l->set_max_step_tokens(lim.max_step_tokens);
  l->set_max_batch_entries(lim.max_batch_entries);
  l->set_max_sequences(lim.max_sequences);
  l->set_max_id_bytes(static_cast<int64_t>(lim.max_id_bytes));
  l->set_max_shm_regions(options_.max_shm_regions);
  l->set_check_finite(lim.check_finite);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::OpenSequence(grpc::CallbackServerContext* ctx,
                                                         const v1::OpenSequenceRequest* req,
                                                         v1::SequenceInfo* resp) {
  return Unary(ctx, "OpenSequence", [&](const Caller& c) { return DoOpenSequence(c, *req, resp); });
}

absl::Status AttentionService::DoOpenSequence(const Caller& caller,
                                              const v1::OpenSequenceRequest& req,
                                              v1::SequenceInfo* resp) {
  if (draining_) return Draining();
  if (!req.fork_parent_id().empty() && req.import_length() != 0)
    return absl::InvalidArgumentError("import_length: a fork is not a handoff target");
  if (req.fork_parent_id().empty() && req.fork_prefix_len() != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("fork_prefix_len: ", req.fork_prefix_len(), " given without fork_parent_id"));
  absl::Status s =
      req.fork_parent_id().empty()
          ? engine_->OpenSequence(KeyOf(caller, req.sequence_id()), -1, req.import_length())
          : engine_->ForkSequence(KeyOf(caller, req.sequence_id()), req.fork_parent_id(),
                                  req.fork_prefix_len());
  RETURN_IF_ERROR(s);
  ASSIGN_OR_RETURN(SequenceInfo info, engine_->DescribeSequence(KeyOf(caller, req.sequence_id())));
  FillSequence(info, *engine_, resp);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::CloseSequence(grpc::CallbackServerContext* ctx,
                                                          const v1::CloseSequenceRequest* req,
                                                          v1::CloseSequenceResponse*) {
  return Unary(ctx, "CloseSequence", [&](const Caller& c) { return DoCloseSequence(c, *req); });
}

absl::Status AttentionService::DoCloseSequence(const Caller& caller,
                                               const v1::CloseSequenceRequest& req) {
  return engine_->CloseSequence(KeyOf(caller, req.sequence_id()));
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
  ASSIGN_OR_RETURN(SequenceInfo info, engine_->DescribeSequence(KeyOf(caller, req.sequence_id())));
  FillSequence(info, *engine_, resp);
  return absl::OkStatus();
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
  }
  StepOptions opts;
  opts.write_only = req.write_only();
  opts.context_parallel = req.context_parallel();
  opts.attend_only = req.attend_only();
  opts.tenant = caller.tenant;
  opts.channel = shards > 1 ? 0 : channel;  // every shard's stream or call drives a sharded step
  ASSIGN_OR_RETURN(uint64_t step, engine_->BeginStep(batch, opts));
  if (shards > 1) shards_.Register(RefOf(caller, step), shards);
  int64_t tokens = 0;  // the engine bounded the sum
  for (const auto& e : batch) tokens += e.q_len;
  resp->set_step_id(step);
  resp->set_num_tokens(tokens);
  return step;
}

absl::StatusOr<int64_t> AttentionService::Join(const StepRef& step, int shard) {
  RETURN_IF_ERROR(shards_.CheckJoin(step, shard));
  ASSIGN_OR_RETURN(Engine::StepInfo info, engine_->DescribeStep(step));
  return info.tokens;
}

void AttentionService::AbortEverywhere(const StepRef& step, const absl::Status& why,
                                       AbortReason reason) {
  (void)engine_->AbortStep(step, reason);
  shards_.Fail(step, why);
}

void AttentionService::FailParkedShards() {
  for (const StepRef& step : shards_.Steps())
    AbortEverywhere(step, absl::CancelledError("attnd is shutting down; step aborted"),
                    AbortReason::kDrain);
}

void AttentionService::ReapShards(std::chrono::steady_clock::duration idle) {
  // Steps the engine no longer has (expired while no shard was waiting): answer any parked part
  // now and drop the entry, which would otherwise stay until every shard's stream ends.
  for (const StepRef& step : shards_.Steps())
    if (!engine_->DescribeStep(step).ok())
      shards_.Fail(step, absl::DeadlineExceededError(
                             absl::StrCat("step ", step.id, " expired or ended; step aborted")));
  for (const StepRef& step : shards_.Stale(idle))
    AbortEverywhere(step,
                    absl::DeadlineExceededError(absl::StrCat(
                        "step ", step.id, ": a shard's layer message never came; step aborted")),
                    AbortReason::kExpiry);
}

void AttentionService::LayerAsync(const Caller& caller, const StepRef& step,
                                  const v1::LayerInputs* in, v1::LayerOutput* out,
                                  Transport transport, std::function<void(absl::Status)> done) {
  if (shards_.NumShards(step) == 0) {
    executor_->Post([this, caller, step, in, out, transport, done = std::move(done)] {
      done(Guarded([&] { return Layer(caller, step, *in, out, transport); }));
    });
    return;
  }
  auto parts = shards_.Add(step, {in, out, done});
  if (!parts.ok()) {
    AbortEverywhere(step, parts.status(), AbortReason::kError);
    done(parts.status());
    return;
  }
  if (!parts->has_value()) return;  // parked until the other shards arrive
  executor_->Post([this, caller, step, transport, all = std::move(**parts)] {
    absl::Status s = Guarded([&] { return LayerSharded(caller, step, all, transport); });
    if (!s.ok()) {
      (void)engine_->AbortStep(step, AbortReason::kError);  // every error aborts the step
      shards_.Forget(step);
    } else if (all[0].out->committed()) {
      shards_.Forget(step);
    }
    for (const auto& p : all) p.done(s);
  });
}

absl::Status AttentionService::LayerSharded(const Caller& caller, const StepRef& step,
                                            const std::vector<ShardGather::Part>& parts,
                                            Transport transport) {
  const ShmAccess shm_access = ShmFor(caller);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(Engine::StepInfo info, engine_->DescribeStep(step));
  const ModelSpec& s = engine_->spec();
  const int S = static_cast<int>(parts.size());
  const int Hs = s.num_heads / S, L = s.kv_lora_rank, R = s.qk_rope_head_dim;
  const int64_t T = info.tokens;
  std::vector<LayerInputs> v(S);
  ShmTransfers shm;
  for (int k = 0; k < S; ++k) {
    if (parts[k].in->return_attended())
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", k, ": return_attended is not served on sharded steps"));
    if (parts[k].in->return_candidates() || parts[k].in->has_selection())
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k, ": return_candidates and selection belong to context-parallel steps"));
    if (!parts[k].in->out_datatype().empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": out_datatype is not served on sharded steps (the reply is in q_latent's)"));
    RETURN_IF_ERROR(ViewOf(*parts[k].in, shm_access, &shm, &v[k]));
    if (v[k].q_nope.present)
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": q_nope (server-side absorption) is not served on sharded steps; send q_latent"));
    const std::string ql = absl::StrCat("q_latent (shard ", k, ")");
    const std::string qr = absl::StrCat("q_rope (shard ", k, ")");
    RETURN_IF_ERROR(CheckTensor(ql.c_str(), v[k].q_latent, {T, Hs, L}));
    RETURN_IF_ERROR(CheckTensor(qr.c_str(), v[k].q_rope, {T, Hs, R}));
    if (v[k].q_latent.dtype == DType::kFP8E4M3 || v[k].q_rope.dtype == DType::kFP8E4M3 ||
        v[k].q_latent.scales != nullptr || v[k].q_rope.scales != nullptr)
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": FP8_E4M3 q_latent/q_rope are not served on sharded steps; send BF16 or FP32"));
    if (v[k].q_latent.dtype != v[0].q_latent.dtype || v[k].q_rope.dtype != v[0].q_rope.dtype)
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", k, ": q_latent/q_rope datatypes differ from shard 0's"));
    if (k > 0 && (v[k].kv_latent.present || v[k].k_rope.present || v[k].index_q.present ||
                  v[k].index_k.present || v[k].index_w.present))
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k, ": only shard 0 sends kv_latent, k_rope and the indexer tensors"));
  }
  const int layer = parts[0].in->layer();
  const DType dt = v[0].q_latent.dtype;
  // All heads, token-major: [T, H, *] gathered from S slices of [T, H/S, *] once the inputs are
  // read (the sink's Prepare); sized now, so the request's views can point at them.
  std::string ql(v[0].q_latent.nbytes * S, '\0'), qr(v[0].q_rope.nbytes * S, '\0');
  LayerRequest request;
  request.layer = layer;
  request.tensors = v[0];  // shard 0's keys and indexer tensors
  request.tensors.q_latent = TensorView::Of(dt, {T, s.num_heads, L}, ql.data(), ql.size());
  request.tensors.q_rope =
      TensorView::Of(v[0].q_rope.dtype, {T, s.num_heads, R}, qr.data(), qr.size());
  for (int k = 0; k < S; ++k) request.want_lse |= parts[k].in->return_lse();
  // Every shard's output buffer before the layer runs: the last layer commits, so nothing may
  // fail after it.
  std::string out;
  std::vector<char*> dst(S);
  auto gather = [&](auto member, int dim, std::string* full) {
    const size_t slice = static_cast<size_t>(Hs) * dim * DTypeSize((v[0].*member).dtype);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < S; ++k)
        std::memcpy(full->data() + (t * S + k) * slice,
                    static_cast<const char*>((v[k].*member).data) + t * slice, slice);
  };
  struct ShardSink final : LayerSink {
    std::function<absl::StatusOr<void*>(const LayerShape&)> fn;
    absl::StatusOr<void*> Prepare(const LayerShape& shape) override { return fn(shape); }
  } sink;
  sink.fn = [&](const LayerShape& shape) -> absl::StatusOr<void*> {
    LayerShape mine = shape;  // each shard's reply: its heads
    mine.heads = Hs;
    mine.out_bytes = shape.out_bytes / S;
    for (int k = 0; k < S; ++k) {
      mine.lse_floats = parts[k].in->return_lse() ? static_cast<size_t>(T) * Hs : 0;
      if (absl::Status fits = CheckReplyFits(mine, *parts[k].in, false, reply_limits()); !fits.ok())
        return absl::InvalidArgumentError(absl::StrCat("shard ", k, ": ", fits.message()));
    }
    for (int k = 0; k < S; ++k) {
      ASSIGN_OR_RETURN(void* out_k,
                       PrepareOutput(*parts[k].in, parts[k].out->mutable_out(), dt, T, Hs, L,
                                     options_.max_message_bytes, shm_access, &shm));
      dst[k] = static_cast<char*>(out_k);
    }
    RETURN_IF_ERROR(shm.ReadInputs());
    // Shard 0's key and indexer views, now read (their shared-memory bytes are in `shm`).
    LayerInputs& all = request.tensors;
    all.kv_latent = v[0].kv_latent;
    all.k_rope = v[0].k_rope;
    all.index_q = v[0].index_q;
    all.index_k = v[0].index_k;
    all.index_w = v[0].index_w;
    gather(&LayerInputs::q_latent, L, &ql);
    gather(&LayerInputs::q_rope, R, &qr);
    RETURN_IF_ERROR(shm.CheckOutputRegions());
    out.assign(shape.out_bytes, '\0');
    return static_cast<void*>(out.data());
  };
  ASSIGN_OR_RETURN(const LayerResult result, engine_->RunLayer(step, request, &sink));
  const std::vector<float>& lse = result.lse;
  const size_t slice = static_cast<size_t>(Hs) * L * DTypeSize(dt);
  for (int k = 0; k < S; ++k) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(dst[k] + t * slice, out.data() + (t * S + k) * slice, slice);
    if (parts[k].in->return_lse())
      SetLse(lse, T, s.num_heads, k * Hs, Hs, parts[k].out->mutable_lse());
    parts[k].out->set_layer(layer);
    parts[k].out->set_committed(layer == s.num_layers() - 1);
  }
  if (absl::Status w = shm.WriteOutputs(); !w.ok())  // the caller aborts the step
    return OutputWriteError(step.id, layer == s.num_layers() - 1, w);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t received = 0, sent = 0;
  for (const auto& p : parts) {
    p.out->set_server_seconds(seconds);
    received += p.in->ByteSizeLong();
    sent += p.out->ByteSizeLong();
  }
  metrics_->LayerDone(transport, info.phase, s.layers[layer], seconds, received, sent);
  if (layer == s.num_layers() - 1)
    metrics_->StepDone(
        info.phase,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - info.begun).count());
  return absl::OkStatus();
}

ReplyLimits AttentionService::reply_limits() const {
  return {options_.max_message_bytes, max_attended_positions()};
}

absl::Status AttentionService::Layer(const Caller& caller, const StepRef& step,
                                     const v1::LayerInputs& in, v1::LayerOutput* out,
                                     Transport transport) {
  const ShmAccess shm_access = ShmFor(caller);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(Engine::StepInfo info, engine_->DescribeStep(step));
  DecodedLayer decoded;
  absl::Status st = [&]() -> absl::Status {
    if (in.shard() != 0)
      return absl::InvalidArgumentError(absl::StrCat("shard: ", in.shard(), " given on step ",
                                                     step.id, ", which is not sharded"));
    return DecodeLayer(in, info, shm_access, &decoded);
  }();
  if (!st.ok()) {  // every error aborts the step, as in the engine
    (void)engine_->AbortStep(step, AbortReason::kError);
    return st;
  }
  ReplySink sink(in, &decoded, shm_access, reply_limits(), out);
  absl::StatusOr<LayerResult> result = engine_->RunLayer(step, decoded.request, &sink);
  if (!result.ok()) {
    out->set_layer(in.layer());
    out->set_committed(false);
    return result.status();
  }
  EncodeLayerResult(*result, in, decoded, sink, out);
  const bool last = result->committed;
  // After the layer ran: a region that shrank meanwhile is written past its new end (pwrite grows
  // it back), never a fault; only an I/O error fails here. Every error aborts the step, and
  // after the last layer, which committed, the error says so.
  if (absl::Status w = decoded.shm.WriteOutputs(); !w.ok()) {
    if (!last) (void)engine_->AbortStep(step, AbortReason::kError);
    return OutputWriteError(step.id, last, w);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out->set_server_seconds(seconds);
  metrics_->LayerDone(transport, info.phase, result->shape.kind, seconds, in.ByteSizeLong(),
                      out->ByteSizeLong());
  if (last)
    metrics_->StepDone(
        info.phase,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - info.begun).count());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::BeginStep(grpc::CallbackServerContext* ctx,
                                                      const v1::BeginStepRequest* req,
                                                      v1::BeginStepResponse* resp) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) {
    Report("BeginStep", caller.status());
    return Done(ctx, caller.status());
  }
  auto* reactor = ctx->DefaultReactor();
  executor_->Post([this, caller = *std::move(caller), req, resp, reactor] {
    const absl::Status s = Guarded([&] { return Begin(caller, *req, resp).status(); });
    Report("BeginStep", s);
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::AttendLayer(grpc::CallbackServerContext* ctx,
                                                        const v1::AttendLayerRequest* req,
                                                        v1::AttendLayerResponse* resp) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) {
    Report("AttendLayer", caller.status());
    return Done(ctx, caller.status());
  }
  const StepRef step = RefOf(*caller, req->step_id());
  // Another tenant's step, or a stream's, reads as absent (before any shard bookkeeping).
  if (absl::Status s = engine_->DescribeStep(step).status(); !s.ok()) {
    Report("AttendLayer", s);
    return Done(ctx, s);
  }
  auto* reactor = ctx->DefaultReactor();
  LayerAsync(*caller, step, &req->inputs(), resp->mutable_output(), Transport::kUnary,
             [this, ctx, step, resp, reactor](absl::Status s) {
               if (s.ok() && ctx->IsCancelled() && !resp->output().committed()) {
                 // The caller will never see this output: leave its sequences as before.
                 s = absl::CancelledError("call cancelled; step aborted");
                 AbortEverywhere(step, s, AbortReason::kCancel);
               }
               Report("AttendLayer", s);
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

// Streams a sequence's keys chunk by chunk, one layer per message; the next message is read out
// of the cache only when the previous one is written (bounded memory for long sequences). Reads
// run on the executor, never on a gRPC thread (a device read may wait for the device).
class ExportStream final : public grpc::ServerWriteReactor<v1::ExportChunk> {
 public:
  ExportStream(AttentionService* svc, const v1::ExportSequenceRequest& req,
               absl::StatusOr<Caller> caller, absl::StatusOr<int64_t> chunk,
               int64_t max_message_bytes)
      : svc_(svc),
        engine_(svc->engine()),
        executor_(svc->executor()),
        max_message_bytes_(max_message_bytes) {
    if (!caller.ok() || !chunk.ok()) {
      End(caller.ok() ? chunk.status() : caller.status());
      return;
    }
    chunk_ = *chunk;
    id_ = KeyOf(*caller, req.sequence_id());
    auto info = Guarded([&] { return engine_->DescribeSequence(id_); });
    if (!info.ok()) {
      End(info.status());
      return;
    }
    length_ = info->length;
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "export: client went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    executor_->Post([this] {
      const absl::Status s = Guarded([&] { return Fill(); });
      if (!s.ok()) {
        End(s);
      } else if (done_) {
        Finish(grpc::Status::OK);
      } else {
        StartWrite(&msg_);
      }
    });
  }
  absl::Status Fill() {
    const ModelSpec& s = engine_->spec();
    if (begin_ >= length_) {
      done_ = true;
      return absl::OkStatus();
    }
    const int64_t n = std::min(chunk_, length_ - begin_);
    RETURN_IF_ERROR(ReadExportChunk(*engine_, id_, layer_, begin_, n, length_, &msg_));
    if (++layer_ == s.num_layers()) {
      layer_ = 0;
      begin_ += n;
    }
    if (static_cast<int64_t>(msg_.ByteSizeLong()) > max_message_bytes_)  // cannot happen: chunk_
      return absl::InternalError("export: a chunk outgrew the message limit");  // is bounded
    return absl::OkStatus();
  }

  void End(const absl::Status& s) {
    svc_->Report("ExportSequence", s);
    Finish(ToGrpcStatus(s));
  }

  AttentionService* svc_;
  Engine* engine_;
  Executor* executor_;
  int64_t max_message_bytes_;
  bool done_ = false;
  SequenceKey id_{""};
  int64_t chunk_ = 0;
  int64_t length_ = 0;
  int64_t begin_ = 0;
  int layer_ = 0;
  v1::ExportChunk msg_;
};

absl::StatusOr<int64_t> AttentionService::ExportChunkTokens(
    const v1::ExportSequenceRequest& req) const {
  const int64_t max = max_export_chunk_tokens();
  if (req.chunk_tokens() < 0 || req.chunk_tokens() > max)
    return absl::InvalidArgumentError(absl::StrCat("chunk_tokens: ", req.chunk_tokens(),
                                                   " outside [0, ", max,
                                                   "] (0 = default; at most what fits in a "
                                                   "message of max_message_bytes)"));
  return req.chunk_tokens() > 0 ? req.chunk_tokens() : std::min<int64_t>(4096, max);
}

grpc::ServerWriteReactor<v1::ExportChunk>* AttentionService::ExportSequence(
    grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* req) {
  return new ExportStream(this, *req, Authenticate(*ctx), ExportChunkTokens(*req),
                          options_.max_message_bytes);
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

absl::Status AttentionService::RequireAdmin(const Caller& caller, const char* method,
                                            const char* why) const {
  const bool open = options_.auth == nullptr || options_.auth->options().mode == AuthMode::kNone;
  if (open || caller.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(method, ": only the admin identity (--admin-tenant)", why));
}

grpc::ServerUnaryReactor* AttentionService::Drain(grpc::CallbackServerContext* ctx,
                                                  const v1::DrainRequest* req, v1::DrainResponse*) {
  return Unary(ctx, "Drain", [&](const Caller& c) -> absl::Status {
    RETURN_IF_ERROR(RequireAdmin(c, "Drain", ""));
    if (!options_.start_drain) return absl::UnimplementedError("Drain: not served here");
    options_.start_drain(std::vector<std::string>(req->peers().begin(), req->peers().end()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AttentionService::UploadAbsorption(grpc::CallbackServerContext* ctx,
                                                             const v1::UploadAbsorptionRequest* req,
                                                             v1::UploadAbsorptionResponse* resp) {
  return Unary(ctx, "UploadAbsorption",
               [&](const Caller& c) { return DoUploadAbsorption(c, *req, resp); });
}

absl::Status AttentionService::DoUploadAbsorption(const Caller& caller,
                                                  const v1::UploadAbsorptionRequest& req,
                                                  v1::UploadAbsorptionResponse* resp) {
  RETURN_IF_ERROR(RequireAdmin(caller, "UploadAbsorption", ": the weights serve every tenant"));
  const ModelSpec& s = engine_->spec();
  const int layers = s.num_layers();
  if (req.first_layer() < 0 || req.first_layer() >= layers ||
      req.kv_b_proj_size() > layers - req.first_layer())
    return absl::InvalidArgumentError(absl::StrCat(
        "UploadAbsorption: layers [", req.first_layer(), ", ",
        int64_t{req.first_layer()} + req.kv_b_proj_size(), ") outside the model's ", layers));
  std::lock_guard<std::mutex> lock(upload_mu_);
  if (upload_ == nullptr || upload_->qk_nope_head_dim() != req.qk_nope_head_dim() ||
      upload_->v_head_dim() != req.v_head_dim()) {  // a new upload (other dims restart it)
    ASSIGN_OR_RETURN(upload_,
                     Absorption::Create(s, req.qk_nope_head_dim(), req.v_head_dim(), "upload"));
  }
  std::vector<float> w;
  for (int i = 0; i < req.kv_b_proj_size(); ++i) {
    const v1::Tensor& t = req.kv_b_proj(i);
    const int layer = req.first_layer() + i;
    const std::string name = absl::StrCat("kv_b_proj[", i, "] (layer ", layer, ")");
    const std::optional<DType> dt = ParseDType(t.datatype());
    if (!dt || *dt == DType::kFP8E4M3)
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": datatype '", t.datatype(), "'; send FP32, BF16 or FP16"));
    if (t.has_shm() || t.has_scales())
      return absl::InvalidArgumentError(absl::StrCat(name, ": give the bytes inline"));
    const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    const int64_t want = int64_t{s.num_heads} * (req.qk_nope_head_dim() + req.v_head_dim());
    if (shape.size() != 2 || shape[0] != want || shape[1] != s.kv_lora_rank)
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape [", absl::StrJoin(shape, ", "),
                                                     "], expected [H*(Dn+V), L] = [", want, ", ",
                                                     s.kv_lora_rank, "]"));
    const size_t n = static_cast<size_t>(want) * s.kv_lora_rank;
    if (t.data().size() != n * DTypeSize(*dt))
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", t.data().size(), " bytes, expected ", n * DTypeSize(*dt)));
    w.resize(n);
    ConvertToF32(*dt, t.data().data(), w.data(), n);
    RETURN_IF_ERROR(upload_->SetLayer(layer, shape, w.data()));
  }
  resp->set_layers_received(upload_->layers_set());
  if (!upload_->complete()) return absl::OkStatus();
  std::shared_ptr<const Absorption> done(std::move(upload_));
  upload_.reset();
  RETURN_IF_ERROR(engine_->SetAbsorption(std::move(done)));
  resp->set_complete(true);
  return absl::OkStatus();
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

// One bidirectional stream: a sequence of steps, one message and one reply at a time. Its caller
// is authenticated once, when the stream starts; an unsharded step it begins is bound to it.
class AttentionService::StepStream final
    : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepStream(AttentionService* svc, absl::StatusOr<Caller> caller, uint64_t channel)
      : svc_(svc), channel_(channel) {
    if (!caller.ok()) {
      svc_->Report("Step", caller.status());
      FinishOnce(ToGrpcStatus(caller.status()));
      return;
    }
    caller_ = *std::move(caller);
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or the call is gone
      const bool had_step = AbortOpenStep();
      FinishOnce(had_step ? grpc::Status(grpc::StatusCode::CANCELLED,
                                         "stream closed with a step open; step aborted")
                          : grpc::Status::OK);
      return;
    }
    resp_.Clear();
    const absl::Status s = Guarded([&] { return Handle(); });
    if (!s.ok()) Fail(s);
  }

  // Handles req_: answers it (now or from the executor) or returns the error that ends the call.
  absl::Status Handle() {
    switch (req_.kind_case()) {
      case v1::StepRequest::kBegin: {
        if (step_ != 0) {
          if (svc_->engine()->DescribeStep(Open()).ok())
            return absl::FailedPreconditionError(
                absl::StrCat("step ", step_.load(),
                             " is still open on this stream; send its layers or abort it"));
          step_ = 0;  // it expired or was aborted meanwhile: nothing is open on this stream
        }
        // Begin may wait for a step being aborted: off the gRPC thread.
        svc_->executor()->Post([this] {
          auto step = Guarded(
              [&] { return svc_->Begin(caller_, req_.begin(), resp_.mutable_begun(), channel_); });
          if (!step.ok()) return Fail(step.status());
          step_channel_ = req_.begin().num_shards() > 1 ? 0 : channel_;
          step_ = *step;
          shard_ = 0;
          StartWrite(&resp_);
        });
        return absl::OkStatus();
      }
      case v1::StepRequest::kLayer: {
        if (step_ == 0)
          return absl::FailedPreconditionError("no open step on this stream: send begin");
        const StepRef step = Open();
        if (svc_->NumShards(step) > 0 && req_.layer().shard() != shard_)
          return absl::InvalidArgumentError(
              absl::StrCat("shard: the message says ", req_.layer().shard(),
                           " but this stream is shard ", shard_, " of step ", step.id));
        svc_->LayerAsync(caller_, step, &req_.layer(), resp_.mutable_layer(), Transport::kStream,
                         [this](absl::Status s) {
                           if (!s.ok()) {
                             step_ = 0;  // the step was aborted for every shard
                             return Fail(s);
                           }
                           if (resp_.layer().committed()) step_ = 0;
                           StartWrite(&resp_);
                         });
        return absl::OkStatus();
      }
      case v1::StepRequest::kJoin: {
        if (step_ != 0 && svc_->engine()->DescribeStep(Open()).ok())
          return absl::FailedPreconditionError(
              absl::StrCat("step ", step_.load(), " is still open on this stream"));
        step_ = 0;
        const StepRef joined(caller_.tenant, req_.join().step_id());  // sharded: no channel
        ASSIGN_OR_RETURN(int64_t tokens, svc_->Join(joined, req_.join().shard()));
        step_channel_ = 0;
        step_ = joined.id;
        shard_ = req_.join().shard();
        resp_.mutable_joined()->set_step_id(joined.id);
        resp_.mutable_joined()->set_num_tokens(tokens);
        StartWrite(&resp_);
        return absl::OkStatus();
      }
      case v1::StepRequest::kAbort: {
        AbortOpenStep(AbortReason::kAbort);
        resp_.mutable_aborted();
        StartWrite(&resp_);
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError("StepRequest: set one of begin, join, layer, abort");
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      AbortOpenStep();
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "write failed; step aborted"));
      return;
    }
    StartRead(&req_);
  }

  void OnCancel() override {
    // Reads and writes in flight fail and finish the call; an executing layer finishes and its
    // write fails. Abort here too so a step never outlives a cancelled stream.
    AbortOpenStep();
  }

  void OnDone() override {
    AbortOpenStep();
    delete this;
  }

 private:
  // The open step as this stream names it.
  StepRef Open() const { return StepRef(caller_.tenant, step_.load(), step_channel_.load()); }
  // Returns whether a step was open.
  bool AbortOpenStep(AbortReason reason = AbortReason::kCancel) {
    const uint64_t channel = step_channel_.load();
    const uint64_t step = step_.exchange(0);
    if (step == 0) return false;
    svc_->AbortEverywhere(StepRef(caller_.tenant, step, channel),
                          absl::CancelledError("another shard's stream ended; step aborted"),
                          reason);
    return true;
  }
  void Fail(const absl::Status& s) {
    AbortOpenStep(AbortReason::kError);
    svc_->Report("Step", s);
    FinishOnce(ToGrpcStatus(s));
  }
  // Finish is called outside mu_: once it is called OnDone may run (and delete this) on another
  // thread at any moment, so nothing of this object may be touched after it.
  void FinishOnce(const grpc::Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(s);
  }

  AttentionService* svc_;
  Caller caller_;
  const uint64_t channel_;  // binds this stream's unsharded steps to it
  v1::StepRequest req_;
  v1::StepResponse resp_;
  std::atomic<uint64_t> step_{0};
  std::atomic<uint64_t> step_channel_{0};  // the open step's channel (0: sharded)
  int shard_ = 0;                          // the shard this stream plays in a sharded step
  std::mutex mu_;
  bool finished_ = false;
};

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* AttentionService::Step(
    grpc::CallbackServerContext* ctx) {
  return new StepStream(this, Authenticate(*ctx), next_channel_++);
}

}  // namespace attnd
