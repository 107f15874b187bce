// The layer call of an unsharded step: decode (layer_codec) -> Engine::RunLayer -> encode, and
// the unary AttendLayer handler that posts it (or parks a sharded step's message).
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/replication_hook.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/layer_check.h"
#include "kv_store/cache_layout.h"
#include "service/attention_service.h"
#include "service/layer_codec.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {

std::function<void(absl::Status)> AttentionService::AfterStandby(
    const StepRef& step, v1::LayerOutput* out,
    std::shared_ptr<const std::vector<LayerResult::Committed>> committed,
    std::function<void(absl::Status)> done) {
  if (replicator_ == nullptr) return done;
  // Standby replicas: a committing layer's reply waits as the replication mode says (sync: for
  // the standby's acknowledgement; async: while the lag is beyond its bound).
  return [this, tenant = step.tenant, out, committed = std::move(committed),
          done = std::move(done)](absl::Status s) {
    if (!s.ok() || out == nullptr || !out->committed()) return done(s);
    std::vector<SequenceKey> keys;
    std::vector<int64_t> lengths;
    bool known = true;
    for (const LayerResult::Committed& c : *committed) {
      keys.emplace_back(tenant, c.id);
      lengths.push_back(c.length);
      known = known && c.length >= 0;
    }
    replicator_->Committed(
        keys,
        [out, done](absl::Status st, ReplicationHook::Protections p) {
          if (st.ok())
            for (std::string& word : p) out->add_protection(std::move(word));
          done(st);
        },
        known ? &lengths : nullptr);
  };
}

void AttentionService::LayerAsync(const Caller& caller, const StepRef& step,
                                  const v1::LayerInputs* in, v1::LayerOutput* out,
                                  Transport transport, std::function<void(absl::Status)> done) {
  AfterLandings(caller, *in,
                [this, caller, step, in, out, transport, done = std::move(done)](bool deferred) {
                  LayerLanded(caller, step, in, out, transport, done, deferred);
                });
}

void AttentionService::LayerLanded(const Caller& caller, const StepRef& step,
                                   const v1::LayerInputs* in, v1::LayerOutput* out,
                                   Transport transport, std::function<void(absl::Status)> done,
                                   bool on_executor) {
  // Where the layer runs: here when already on an executor thread, else posted to one.
  auto run = [this, on_executor](std::function<void()> task) {
    if (on_executor) return task();
    executor_->Post(std::move(task));
  };
  if (shards_.NumShards(step) == 0) {
    // The engine resolves the step, checks it is the caller's, and names its sequences if the
    // layer commits: nothing is looked up here.
    auto committed =
        replicator_ != nullptr ? std::make_shared<std::vector<LayerResult::Committed>>() : nullptr;
    done = AfterStandby(step, out, committed, std::move(done));
    run([this, caller, step, in, out, transport, committed, done = std::move(done)] {
      done(Guarded([&] { return Layer(caller, step, *in, out, transport, committed.get()); }));
    });
    return;
  }
  // A sharded step: its parts are gathered first and run together (LayerSharded), so the ids
  // its last layer commits are read here.
  if (replicator_ != nullptr) {
    auto info = engine_->DescribeStep(step);
    if (info.ok() && info->next_layer == engine_->spec().num_layers() - 1) {
      absl::StatusOr<std::vector<std::string>> ids = engine_->StepSequenceIds(step);
      if (ids.ok()) {
        auto committed = std::make_shared<std::vector<LayerResult::Committed>>();
        for (std::string& id : *ids) committed->push_back({std::move(id), -1});  // looked up
        done = AfterStandby(step, out, std::move(committed), std::move(done));
      }
    }
  }
  auto parts = shards_.Add(step, {in, out, done, ShmFor(caller)});
  if (!parts.ok()) {
    AbortEverywhere(step, parts.status(), AbortReason::kError);
    done(parts.status());
    return;
  }
  if (!parts->has_value()) return;  // parked until the other shards arrive
  run([this, step, transport, all = std::move(**parts)] {
    absl::Status s = Guarded([&] { return LayerSharded(step, all, transport); });
    if (!s.ok()) {
      (void)engine_->AbortStep(step, AbortReason::kError);  // every error aborts the step
      shards_.Forget(step);
    } else if (all[0].out->committed()) {
      shards_.Forget(step);
    }
    for (const auto& p : all) p.done(s);
  });
}

ReplyLimits AttentionService::reply_limits() const {
  return {options_.max_message_bytes, max_attended_positions()};
}

namespace {

// A layer message as the engine decodes it: against the step it looked up, once the step is
// this call's.
class WireLayer final : public LayerSource {
 public:
  WireLayer(uint64_t step_id, const v1::LayerInputs& in, const ShmAccess& shm, bool want_committed)
      : step_id_(step_id), in_(in), shm_(shm), want_committed_(want_committed) {}
  int layer() const override { return in_.layer(); }
  absl::StatusOr<const LayerRequest*> Decode(const Engine::StepInfo& step) override {
    info_ = step;
    if (in_.shard() != 0)
      return absl::InvalidArgumentError(absl::StrCat("shard: ", in_.shard(), " given on step ",
                                                     step_id_, ", which is not sharded"));
    RETURN_IF_ERROR(DecodeLayer(in_, step, shm_, &decoded_));
    decoded_.request.want_committed = want_committed_;
    return &decoded_.request;
  }
  DecodedLayer& decoded() { return decoded_; }
  const Engine::StepInfo& info() const { return info_; }  // once decoded

 private:
  uint64_t step_id_;
  const v1::LayerInputs& in_;
  const ShmAccess& shm_;
  bool want_committed_;
  Engine::StepInfo info_;
  DecodedLayer decoded_;
};

}  // namespace

absl::Status AttentionService::Layer(const Caller& caller, const StepRef& step,
                                     const v1::LayerInputs& in, v1::LayerOutput* out,
                                     Transport transport,
                                     std::vector<LayerResult::Committed>* committed) {
  const ShmAccess shm_access = ShmFor(caller);
  const auto start = std::chrono::steady_clock::now();
  WireLayer source(step.id, in, shm_access, committed != nullptr);
  ReplySink sink(in, &source.decoded(), shm_access, reply_limits(), out);
  absl::StatusOr<LayerResult> result = engine_->RunLayer(step, source, &sink);
  if (!result.ok()) return result.status();  // an error's reply is never sent
  DecodedLayer& decoded = source.decoded();
  const Engine::StepInfo& info = source.info();
  EncodeLayerResult(*result, in, decoded, sink, out);
  const bool last = result->committed;
  if (committed != nullptr) *committed = std::move(result->committed_sequences);
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
  out->set_transfer_seconds(decoded.shm.seconds);
  metrics_->LayerDone(transport, info.phase, result->shape.kind, seconds, in.ByteSizeLong(),
                      out->ByteSizeLong());
  if (last)
    metrics_->StepDone(
        info.phase,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - info.begun).count());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::AttendLayer(grpc::CallbackServerContext* ctx,
                                                        const v1::AttendLayerRequest* req,
                                                        v1::AttendLayerResponse* resp) {
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) {
    Report("AttendLayer", caller.status(), started);
    return Done(ctx, caller.status());
  }
  const StepRef step = RefOf(*caller, req->step_id());
  // Another tenant's sharded step, or a stream's, reads as absent before any shard bookkeeping
  // (an unsharded step's layer is checked where it runs: Engine::RunLayer).
  if (NumShards(step) != 0)
    if (absl::Status s = engine_->DescribeStep(step).status(); !s.ok()) {
      Report("AttendLayer", s, started);
      return Done(ctx, s);
    }
  auto* reactor = ctx->DefaultReactor();
  LayerAsync(*caller, step, &req->inputs(), resp->mutable_output(), Transport::kUnary,
             [this, ctx, step, resp, reactor, started](absl::Status s) {
               if (s.ok() && ctx->IsCancelled() && !resp->output().committed()) {
                 // The caller will never see this output: leave its sequences as before.
                 s = absl::CancelledError("call cancelled; step aborted");
                 AbortEverywhere(step, s, AbortReason::kCancel);
               }
               Report("AttendLayer", s, started);
               reactor->Finish(ToGrpcStatus(s));
             });
  return reactor;
}

}  // namespace attnd
