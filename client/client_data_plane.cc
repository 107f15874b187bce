// The client's use of the UCX data plane (docs/data-plane.md): connecting one (explicitly, or
// by itself on first use under "auto"), replacing a broken one and closing it on the server.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

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
  bool replacing = false;
  if (plane_ != nullptr && plane_->broken()) {
    std::shared_ptr<DataPlaneSession> old = std::move(plane_);  // calls holding it finish first
    plane_next_probe_ = now;
    replacing = true;
    lock.unlock();
    RetirePlane(old);
    lock.lock();
  }
  if (plane_ != nullptr || data_plane_mode_ != "auto" || now < plane_next_probe_ || plane_probing_)
    return plane_;
  plane_probing_ = true;
  if (replacing) {
    // The server's UCX was reached before: a new plane connects at once, and this call uses it.
    lock.unlock();
    ProbePlane();
    lock.lock();
    return plane_;
  }
  // A first probe (or one after a failed probe) runs on a thread of its own: this call and those
  // after it send bytes until it connected a plane (a server whose UCX cannot be reached would
  // otherwise hold a layer call for the connect's limit). The previous probe's thread has ended
  // (none was probing).
  std::thread previous = std::move(plane_probe_);
  plane_probe_ = std::thread([this] { ProbePlane(); });
  lock.unlock();
  if (previous.joinable()) previous.join();
  return nullptr;
}

void Client::ProbePlane() const {
  // Each of its two calls bounded: a server that does not answer is not kept waiting for twice.
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
  std::lock_guard<std::mutex> lock(plane_mu_);
  plane_probing_ = false;
  if (s.ok()) {
    plane_ = std::move(*s);
    plane_failures_ = 0;
    return;
  }
  // None offered: never again. Not reached, refused (the server's limits) or not connected
  // (its UCX out of reach): again in 10 s, twice as long after each failure, at most 10 min.
  const bool none = answered && s.status().code() == absl::StatusCode::kFailedPrecondition;
  const auto wait = std::min<std::chrono::seconds>(
      std::chrono::seconds(int64_t{10} << std::min(plane_failures_++, 6)),
      std::chrono::minutes(10));
  plane_next_probe_ =
      none ? std::chrono::steady_clock::time_point::max() : std::chrono::steady_clock::now() + wait;
}

}  // namespace attnd::client
