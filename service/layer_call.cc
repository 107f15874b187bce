// The layer call of an unsharded step: decode (layer_codec) -> Engine::RunLayer -> encode, and
// the unary AttendLayer handler that posts it (or parks a sharded step's message).
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
#include "service/attention_service.h"
#include "cluster/export_chunk.h"
#include "service/layer_codec.h"
#include "cluster/replication.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {

void AttentionService::LayerAsync(const Caller& caller, const StepRef& step,
                                  const v1::LayerInputs* in, v1::LayerOutput* out,
                                  Transport transport, std::function<void(absl::Status)> done) {
  // Standby replicas: a committing layer's reply waits as the replication mode says (sync: for
  // the standby's acknowledgement; async: while the lag is beyond its bound).
  if (replicator_ != nullptr) {
    auto info = engine_->DescribeStep(step);
    absl::StatusOr<std::vector<std::string>> ids = absl::NotFoundError("not its last layer");
    if (info.ok() && info->next_layer == engine_->spec().num_layers() - 1)
      ids = engine_->StepSequenceIds(step);  // the ids only where they are used
    if (ids.ok()) {
      std::vector<SequenceKey> keys;
      for (const std::string& id : *ids) keys.emplace_back(step.tenant, id);
      done = [this, out, keys = std::move(keys), done = std::move(done)](absl::Status s) {
        if (!s.ok() || out == nullptr || !out->committed()) return done(s);
        replicator_->Committed(keys, [out, done](absl::Status st, Replicator::Protections p) {
          if (st.ok())
            for (std::string& word : p) out->add_protection(std::move(word));
          done(st);
        });
      };
    }
  }
  if (shards_.NumShards(step) == 0) {
    executor_->Post([this, caller, step, in, out, transport, done = std::move(done)] {
      done(Guarded([&] { return Layer(caller, step, *in, out, transport); }));
    });
    return;
  }
  auto parts = shards_.Add(step, {in, out, done, ShmFor(caller)});
  if (!parts.ok()) {
    AbortEverywhere(step, parts.status(), AbortReason::kError);
    done(parts.status());
    return;
  }
  if (!parts->has_value()) return;  // parked until the other shards arrive
  executor_->Post([this, step, transport, all = std::move(**parts)] {
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
  if (!result.ok()) return result.status();  // an error's reply is never sent
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
  // Another tenant's step, or a stream's, reads as absent (before any shard bookkeeping).
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
