// The data plane's RPCs (docs/data-plane.md): ConnectDataPlane hands the authenticated caller's
// tenant a UCX plane (transport/ucx_plane.h); its regions are then named in layer calls like
// shared-memory regions (ShmAccess::Resolve). CloseDataPlane ends one; CloseIdlePlanes (the
// server's housekeeping) those whose client is gone.
#include <glog/logging.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/status_macros.h"
#include "service/attention_service.h"
#include "service/service_internal.h"
#include "service/service_metrics.h"
#include "service/tensor_codec.h"
#include "transport/ucx_plane.h"

namespace attnd {

void AttentionService::StartConnectDataPlane(const Caller& caller,
                                             const v1::ConnectDataPlaneRequest& req,
                                             v1::ConnectDataPlaneResponse* resp,
                                             absl::Duration wire_limit,
                                             std::function<void(absl::Status)> finish) {
  if (options_.data_plane == nullptr)
    return finish(absl::FailedPreconditionError(
        "the data plane is off on this server (--data-plane=ucx turns it on); send tensors in "
        "the message"));
  // A tenant with a shared-memory region quota holds at most that many planes (counted apart
  // from its regions: docs/data-plane.md).
  const int64_t quota = engine_->TenantQuotaOf(caller.tenant).shm_regions;
  options_.data_plane->Connect(
      caller.tenant, req.input_bytes(), req.output_bytes(),
      static_cast<int>(std::min<int64_t>(quota, 1 << 20)), req.worker_address(),
      req.sends_keepalives(),
      [resp, finish = std::move(finish)](absl::StatusOr<transport::UcxPlane::Connection> c) {
        if (!c.ok()) return finish(c.status());
        resp->set_plane(c->name);
        resp->set_plane_id(c->id);
        resp->set_token(c->token);
        resp->set_worker_address(c->server_address);
        resp->set_input_region(c->input_region);
        resp->set_output_region(c->output_region);
        resp->set_pushes_outputs(c->pushes);
        resp->set_keepalive_ms(absl::ToInt64Milliseconds(c->keepalive));
        finish(absl::OkStatus());
      },
      wire_limit);
}

void AttentionService::AfterLandings(const Caller& caller, const v1::LayerInputs& in,
                                     std::function<void(bool deferred)> go) {
  if (options_.data_plane == nullptr) return go(false);
  // One count per transfer awaited, plus this function's own (dropped last), so that `go` runs
  // once, after every wait and after they were all set up.
  struct Countdown {
    std::atomic<int> left{1};
    std::function<void(bool)> go;
  };
  auto c = std::make_shared<Countdown>();
  const ShmAccess shm = ShmFor(caller);
  // A transfer named twice is awaited once (at most 16 names: a short list beats a set).
  std::vector<std::pair<const std::string*, uint64_t>> awaited;
  for (const auto& [name, t] : InputTensors(in))
    for (const v1::Tensor* part : {t, &t->scales()}) {
      const v1::SharedMemoryRef& ref = part->shm();
      if (ref.transfer() == 0) continue;  // not the data plane's (or refused by the decode)
      if (std::any_of(awaited.begin(), awaited.end(), [&](const auto& a) {
            return a.second == ref.transfer() && *a.first == ref.region();
          }))
        continue;
      awaited.emplace_back(&ref.region(), ref.transfer());
      auto region = shm.Resolve(name, ref.region(), ref.offset(), ref.byte_size(), ref.transfer());
      if (!region.ok()) continue;
      c->left.fetch_add(1);
      (*region)->WhenLanded(ref.transfer(), [this, c] {
        if (c->left.fetch_sub(1) == 1)
          executor_->Post([this, c] {
            metrics_->CallsWaiting(-1);
            c->go(true);
          });
      });
    }
  if (c->left.load() == 1) return go(false);  // every wait already over (or none): run here
  c->go = std::move(go);
  metrics_->CallsWaiting(+1);
  if (c->left.fetch_sub(1) == 1) {  // the last landed meanwhile
    metrics_->CallsWaiting(-1);
    c->go(false);
  }
}

void AttentionService::CloseIdlePlanes() {
  // On the handshakes' threads, not the caller's (the housekeeping, which expires steps): shutting
  // a plane joins its progress thread, and a round may shut many (a fleet restarted at once). One
  // round queued at a time.
  if (options_.data_plane == nullptr || closing_idle_planes_.exchange(true)) return;
  plane_handshakes_->Post([this] {
    const int n = options_.data_plane->CloseIdle();
    closing_idle_planes_.store(false);
    if (n > 0)
      LOG(INFO) << n << " data plane(s) closed: their client is gone (silent, idle, stalled or "
                << "unreachable; attnd_data_plane_planes_closed_total says which)";
  });
}

grpc::ServerUnaryReactor* AttentionService::ConnectDataPlane(grpc::CallbackServerContext* ctx,
                                                             const v1::ConnectDataPlaneRequest* req,
                                                             v1::ConnectDataPlaneResponse* resp) {
  // Connecting to a pushing client's worker ends by 3/4 of the time the caller gave the call
  // (a plane it pulls from, beyond), so that the answer comes before the caller gives up (the
  // C++ client's probe allows 2 s).
  absl::Duration wire_limit = transport::UcxWorker::kConnectLimit;
  if (const auto deadline = ctx->deadline();
      deadline != std::chrono::system_clock::time_point::max())
    wire_limit =
        std::min(wire_limit, absl::FromChrono(deadline - std::chrono::system_clock::now()) * 3 / 4);
  // Making the plane's worker and registering its regions run on the handshakes' own threads,
  // off gRPC's and the executor's; connecting to a pushing client's worker then holds none (the
  // answer comes from the plane's thread or its timer: UcxPlane::Connect).
  return PostedAsync(
      ctx, "ConnectDataPlane",
      [this, ctx, req, resp, wire_limit](const Caller& caller,
                                         std::function<void(absl::Status)> finish) {
        StartConnectDataPlane(caller, *req, resp, wire_limit,
                              [this, ctx, tenant = caller.tenant, resp, finish](absl::Status s) {
                                if (s.ok() && ctx->IsCancelled()) {
                                  // The caller gave up (its deadline, a cancel) before its plane
                                  // was ready: nobody will use the plane or close it, so it is
                                  // closed here rather than left to stand idle against the limits.
                                  // Not on this thread, which may be the plane's own.
                                  plane_handshakes_->Post([this, tenant, plane = resp->plane()] {
                                    (void)options_.data_plane->Close(tenant, plane);
                                  });
                                  s = absl::CancelledError(
                                      "the caller gave up on the handshake; its plane is closed");
                                }
                                finish(s);
                              });
      },
      plane_handshakes_.get());
}

grpc::ServerUnaryReactor* AttentionService::CloseDataPlane(grpc::CallbackServerContext* ctx,
                                                           const v1::CloseDataPlaneRequest* req,
                                                           v1::CloseDataPlaneResponse*) {
  // Stopping the plane's worker joins its thread: off gRPC's threads and the executor's.
  return Posted(
      ctx, "CloseDataPlane",
      [this, req](const Caller& c) {
        if (options_.data_plane == nullptr)
          return absl::FailedPreconditionError(
              "the data plane is off on this server (--data-plane)");
        return options_.data_plane->Close(c.tenant, req->plane());
      },
      plane_handshakes_.get());
}

}  // namespace attnd
