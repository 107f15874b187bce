// Helpers shared by the files that implement AttentionService (attention_service.cc,
// server_info.cc, layer_call.cc, sharded_layer.cc, step_stream.cc, export_stream.cc,
// absorption_upload.cc). Not an API: only those files include it.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "service/attention_service.h"
#include "service/status_map.h"

namespace attnd {

inline void FillSequence(const SequenceInfo& s, const Engine& e, v1::SequenceInfo* out,
                         bool with_tenant = false) {
  out->set_sequence_id(s.id);
  if (with_tenant) out->set_tenant(s.tenant);
  out->set_length(s.length);
  out->set_device(e.device_name(s.device));
  out->set_num_pages(static_cast<int32_t>(s.pages.size()));
  out->set_in_step(s.in_step);
  out->set_importing(s.importing);
  out->set_tier(TierName(s.tier));
  out->set_moving(s.moving);
  out->set_lost(s.lost);
  out->set_generation(s.generation);
  out->set_standby(s.standby);
}

inline absl::Status Draining() {
  return absl::UnavailableError("attnd is draining: no new sequences or steps; retry elsewhere");
}

inline grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

// A client-supplied sequence id longer than the server allows cannot name a sequence: refuse it
// before it is copied anywhere.
inline absl::Status CheckIdLength(const char* field, const std::string& id, size_t max) {
  if (id.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", id.size(), " bytes, longer than ", max, " (--max-id-bytes)"));
}

// An output that could not be written to its region after the layer ran (only an I/O error can
// do that). After the last layer the step has committed, and the error says so.
inline absl::Status OutputWriteError(uint64_t step, bool committed, const absl::Status& w) {
  if (!committed) return w;
  return absl::DataLossError(absl::StrCat(
      "step ", step, " committed, but its output could not be written to out_shm: ", w.message()));
}

inline StepRef RefOf(const Caller& c, uint64_t step, uint64_t channel = 0) {
  return StepRef(c.tenant, step, channel);
}

inline SequenceKey KeyOf(const Caller& c, const std::string& id) {
  return SequenceKey(c.tenant, id);
}

// The user of the process at the other end of a Unix-socket connection.
inline absl::StatusOr<uid_t> PeerUid(const Caller& c) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  int domain = 0;
  socklen_t dlen = sizeof(domain);
  if (!c.local || getsockopt(c.socket_fd, SOL_SOCKET, SO_DOMAIN, &domain, &dlen) != 0 ||
      domain != AF_UNIX || getsockopt(c.socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return absl::PermissionDeniedError("shared memory: the caller's user is unknown");
  return cred.uid;
}

// Runs `fn(caller)` for an authenticated caller and finishes the call with its status.
template <typename Fn>
grpc::ServerUnaryReactor* AttentionService::Unary(grpc::CallbackServerContext* ctx,
                                                  const char* method, Fn fn) {
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  const absl::Status s = caller.ok() ? Guarded([&] { return fn(*caller); }) : caller.status();
  Report(method, s, started);
  return Done(ctx, s);
}

template <typename Fn>
grpc::ServerUnaryReactor* AttentionService::PostedAsync(grpc::CallbackServerContext* ctx,
                                                        const char* method, Fn fn, Executor* on) {
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) {
    Report(method, caller.status(), started);
    return Done(ctx, caller.status());
  }
  auto* reactor = ctx->DefaultReactor();
  (on != nullptr ? on : executor_)
      ->Post([this, caller = *std::move(caller), fn = std::move(fn), reactor, method, started] {
        auto answered = std::make_shared<std::atomic<bool>>(false);
        std::function<void(absl::Status)> finish = [this, reactor, method, started,
                                                    answered](absl::Status s) {
          if (answered->exchange(true)) return;
          Report(method, s, started);
          reactor->Finish(ToGrpcStatus(s));
        };
        const absl::Status s = Guarded([&] {
          fn(caller, finish);
          return absl::OkStatus();
        });
        if (!s.ok()) finish(s);  // thrown before an answer (after one, that answer stands)
      });
  return reactor;
}

template <typename Fn>
grpc::ServerUnaryReactor* AttentionService::Posted(grpc::CallbackServerContext* ctx,
                                                   const char* method, Fn fn, Executor* on) {
  return PostedAsync(
      ctx, method,
      [fn = std::move(fn)](const Caller& c, const std::function<void(absl::Status)>& finish) {
        finish(fn(c));
      },
      on);
}

}  // namespace attnd
