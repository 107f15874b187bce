// The client's use of the UCX data plane (docs/data-plane.md): connecting one (explicitly, or
// by itself on first use under "auto"), replacing a broken one and closing it on the server.
#include <chrono>
#include <memory>
#include <string>

#include "client/attnd_client.h"
#include "client/data_plane_session.h"

namespace attnd::client {

void Client::RetirePlane(const std::shared_ptr<DataPlaneSession>& old) const {
  if (old == nullptr) return;
  grpc::ClientContext ctx;
  Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::CloseDataPlaneRequest req;
  req.set_plane(old->plane());
  v1::CloseDataPlaneResponse resp;
  (void)stub_->CloseDataPlane(&ctx, req, &resp);  // NOT_FOUND: the server closed it already
}

absl::Status Client::ConnectDataPlane() {
  auto info = Info();
  if (!info.ok()) return info.status();
  auto s = DataPlaneSession::Connect(
      stub_.get(), *info, data_plane_bytes_,
      [this](grpc::ClientContext* ctx) { PrepareUnary(ctx); }, local_target_);
  if (!s.ok()) return s.status();
  std::shared_ptr<DataPlaneSession> old;
  {
    std::lock_guard<std::mutex> lock(plane_mu_);
    old = std::move(plane_);
    plane_ = std::move(*s);
  }
  RetirePlane(old);
  return absl::OkStatus();
}

std::string Client::DataPlaneName() const {
  std::lock_guard<std::mutex> lock(plane_mu_);
  return plane_ != nullptr ? plane_->plane() : "";
}

std::shared_ptr<DataPlaneSession> Client::Plane() const {
  std::unique_lock<std::mutex> lock(plane_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (plane_ != nullptr && plane_->broken()) {
    std::shared_ptr<DataPlaneSession> old = std::move(plane_);  // calls holding it finish first
    plane_next_probe_ = now;
    lock.unlock();
    RetirePlane(old);
    lock.lock();
  }
  if (plane_ != nullptr || data_plane_mode_ != "auto" || now < plane_next_probe_ || plane_probing_)
    return plane_;
  // One probe, outside the lock (other calls send bytes meanwhile), each of its two calls
  // bounded: a server that does not answer is not kept waiting for twice.
  plane_probing_ = true;
  lock.unlock();
  const auto bounded = [this](grpc::ClientContext* c) {
    Authorize(c);
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  };
  grpc::ClientContext ctx;
  bounded(&ctx);
  v1::ServerInfoResponse info;
  const bool answered = stub_->ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok();
  // FAILED_PRECONDITION without a UCX plane offered: bytes in the messages.
  absl::StatusOr<std::unique_ptr<DataPlaneSession>> s =
      absl::UnavailableError("the server did not answer");
  if (answered)
    s = DataPlaneSession::Connect(stub_.get(), info, data_plane_bytes_, bounded, local_target_);
  lock.lock();
  plane_probing_ = false;
  if (s.ok()) {
    plane_ = std::move(*s);
  } else {
    // None offered: never again. Not reached, or refused (the server's limits): in 10 s.
    const bool none = answered && s.status().code() == absl::StatusCode::kFailedPrecondition;
    plane_next_probe_ = none ? std::chrono::steady_clock::time_point::max()
                             : std::chrono::steady_clock::now() + std::chrono::seconds(10);
  }
  return plane_;
}

}  // namespace attnd::client
