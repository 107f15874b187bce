// The Step stream: one bidirectional stream carrying a worker's steps, message by message.
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
#include "service/layer_codec.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {

// One bidirectional stream: a sequence of steps, one message and one reply at a time. Its caller
// is authenticated once, when the stream starts; an unsharded step it begins is bound to it.
class AttentionService::StepStream final
    : public grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse> {
 public:
  StepStream(AttentionService* svc, grpc::CallbackServerContext* ctx, absl::StatusOr<Caller> caller,
             uint64_t channel)
      : svc_(svc), ctx_(ctx), channel_(channel) {
    if (!caller.ok()) {
      FinishOnce(caller.status());
      return;
    }
    caller_ = *std::move(caller);
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or the call is gone
      const bool had_step = AbortOpenStep();
      FinishOnce(had_step ? absl::CancelledError("stream closed with a step open; step aborted")
                          : absl::OkStatus());
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
      FinishOnce(absl::CancelledError("write failed; step aborted"));
      return;
    }
    StartRead(&req_);
  }

  void OnCancel() override {
    // Reads and writes in flight fail and finish the call; an executing layer finishes and its
    // write fails. Abort here too so a step never outlives a cancelled stream.
    cancelled_ = true;
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
    FinishOnce(s);
  }
  // Every end of the stream comes here, so it is counted once (attnd_rpc_requests_total and
  // attnd_rpc_seconds), whatever its outcome. Finish is called outside mu_: once it is called
  // OnDone may run (and delete this) on another thread at any moment, so nothing of this object
  // may be touched after it.
  // A cancelled call is CANCELLED whatever ended it: OnCancel may run before or after the failed
  // read or write, or the layer error, that ends the stream (and may have aborted its step).
  void FinishOnce(const absl::Status& given) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    const absl::Status s =
        (cancelled_.load() || ctx_->IsCancelled()) && given.code() != absl::StatusCode::kCancelled
            ? absl::CancelledError("call cancelled")
            : given;
    svc_->Report("Step", s, started_);
    Finish(ToGrpcStatus(s));
  }

  AttentionService* svc_;
  grpc::CallbackServerContext* const ctx_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  Caller caller_;
  const uint64_t channel_;  // binds this stream's unsharded steps to it
  v1::StepRequest req_;
  v1::StepResponse resp_;
  std::atomic<uint64_t> step_{0};
  std::atomic<bool> cancelled_{false};     // OnCancel ran
  std::atomic<uint64_t> step_channel_{0};  // the open step's channel (0: sharded)
  int shard_ = 0;                          // the shard this stream plays in a sharded step
  std::mutex mu_;
  bool finished_ = false;
};

grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* AttentionService::Step(
    grpc::CallbackServerContext* ctx) {
  return new StepStream(this, ctx, Authenticate(*ctx), next_channel_++);
}

}  // namespace attnd
