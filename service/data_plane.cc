// The data plane's RPCs (docs/data-plane.md): ConnectDataPlane hands the authenticated caller's
// tenant a UCX plane (transport/ucx_plane.h); its regions are then named in layer calls like
// shared-memory regions (ShmAccess::Resolve). CloseDataPlane ends one.
#include <algorithm>

#include "common/status_macros.h"
#include "service/attention_service.h"
#include "service/service_internal.h"
#include "transport/ucx_plane.h"

namespace attnd {

absl::Status AttentionService::DoConnectDataPlane(const Caller& caller,
                                                  const v1::ConnectDataPlaneRequest& req,
                                                  v1::ConnectDataPlaneResponse* resp) {
  if (options_.data_plane == nullptr)
    return absl::FailedPreconditionError(
        "the data plane is off on this server (--data-plane=ucx turns it on); send tensors in "
        "the message");
  // A tenant with a shared-memory region quota holds at most that many planes (counted apart
  // from its regions: docs/data-plane.md).
  const int64_t quota = engine_->TenantQuotaOf(caller.tenant).shm_regions;
  ASSIGN_OR_RETURN(
      transport::UcxPlane::Connection c,
      options_.data_plane->Connect(caller.tenant, req.input_bytes(), req.output_bytes(),
                                   static_cast<int>(std::min<int64_t>(quota, 1 << 20))));
  resp->set_plane(c.name);
  resp->set_plane_id(c.id);
  resp->set_token(c.token);
  resp->set_worker_address(c.server_address);
  resp->set_input_region(c.input_region);
  resp->set_output_region(c.output_region);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::ConnectDataPlane(grpc::CallbackServerContext* ctx,
                                                             const v1::ConnectDataPlaneRequest* req,
                                                             v1::ConnectDataPlaneResponse* resp) {
  // Registering the region with UCX runs on the plane's thread: off gRPC's threads.
  return Posted(ctx, "ConnectDataPlane",
                [this, req, resp](const Caller& c) { return DoConnectDataPlane(c, *req, resp); });
}

grpc::ServerUnaryReactor* AttentionService::CloseDataPlane(grpc::CallbackServerContext* ctx,
                                                           const v1::CloseDataPlaneRequest* req,
                                                           v1::CloseDataPlaneResponse*) {
  return Unary(ctx, "CloseDataPlane", [this, req](const Caller& c) {
    if (options_.data_plane == nullptr)
      return absl::FailedPreconditionError("the data plane is off on this server (--data-plane)");
    return options_.data_plane->Close(c.tenant, req->plane());
  });
}

}  // namespace attnd
