// attnd.v1.Attention over the gRPC callback API. Handlers never block on compute: layer work is
// posted to an Executor and the reply is finished from there.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "attnd/v1/attention.grpc.pb.h"
#include "engine/engine.h"
#include "service/executor.h"
#include "service/service_metrics.h"

namespace attnd {

struct ServiceOptions {
  std::string backend = "cpu";
  int64_t max_message_bytes = 0;
  int64_t step_idle_timeout_ms = 0;
};

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // `engine`, `executor` and `metrics` outlive the service.
  AttentionService(Engine* engine, Executor* executor, ServiceMetrics* metrics,
                   ServiceOptions options);

  // Refuse new sequences and steps with UNAVAILABLE; open steps may finish.
  void SetDraining() { draining_ = true; }
  bool draining() const { return draining_; }

  grpc::ServerUnaryReactor* ServerInfo(grpc::CallbackServerContext* ctx,
                                       const v1::ServerInfoRequest* req,
                                       v1::ServerInfoResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* ctx,
                                         const v1::OpenSequenceRequest* req,
                                         v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* ctx,
                                          const v1::CloseSequenceRequest* req,
                                          v1::CloseSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* DescribeSequence(grpc::CallbackServerContext* ctx,
                                             const v1::DescribeSequenceRequest* req,
                                             v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* BeginStep(grpc::CallbackServerContext* ctx,
                                      const v1::BeginStepRequest* req,
                                      v1::BeginStepResponse* resp) override;
  grpc::ServerUnaryReactor* AttendLayer(grpc::CallbackServerContext* ctx,
                                        const v1::AttendLayerRequest* req,
                                        v1::AttendLayerResponse* resp) override;
  grpc::ServerUnaryReactor* AbortStep(grpc::CallbackServerContext* ctx,
                                      const v1::AbortStepRequest* req,
                                      v1::AbortStepResponse* resp) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* req,
                                 v1::EchoResponse* resp) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* Step(
      grpc::CallbackServerContext* ctx) override;

  // Shared by both transports. Blocking: call from the executor.
  absl::StatusOr<uint64_t> Begin(const v1::BeginStepRequest& req, v1::BeginStepResponse* resp);
  absl::Status Layer(uint64_t step, const v1::LayerInputs& in, v1::LayerOutput* out,
                     Transport transport);
  Executor* executor() { return executor_; }
  Engine* engine() { return engine_; }
  ServiceMetrics* metrics() { return metrics_; }

 private:
  class StepStream;
  Engine* engine_;
  Executor* executor_;
  ServiceMetrics* metrics_;
  ServiceOptions options_;
  std::atomic<bool> draining_{false};
};

}  // namespace attnd
