// attnd.v1.Attention over the gRPC callback API. Handlers never block on compute: layer work is
// posted to an Executor and the reply is finished from there.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "cluster/standby_leases.h"
#include "common/guarded.h"
#include "engine/engine.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/kv_events.h"
#include "service/layer_codec.h"
#include "service/service_metrics.h"
#include "service/shard_gather.h"
#include "service/shm_registry.h"
#include "service/step_log.h"

namespace attnd {

class ReplicationHook;
namespace transport {
class UcxPlane;
}

struct ServiceOptions {
  int64_t max_message_bytes = 0;
  int64_t step_idle_timeout_ms = 0;
  int64_t max_echo_bytes = int64_t{64} << 20;  // Echo replies (also capped by the message size)
  int max_shm_regions = 64;
  // Who calls (null: everyone is the anonymous tenant, no call is local).
  std::shared_ptr<const Authenticator> auth;
  // Shared memory (docs/trust.md): off unless enabled, then only for callers on the Unix-socket
  // listener, for objects under `shm_prefix` owned by the caller's user.
  bool shm_enabled = false;
  std::string shm_prefix = "/attnd-";
  // The UCX data plane (docs/data-plane.md); null: off.
  std::shared_ptr<transport::UcxPlane> data_plane;
  // Starts the drain (the server's SIGTERM path) with these peers (empty: the flags').
  // A Drain call may name only peers among drain_peers (--drain-peers, as given).
  std::vector<std::string> drain_peers;
  std::function<void(std::vector<std::string>)> start_drain;
};

class AttentionService final : public v1::Attention::CallbackService {
 public:
  // `engine`, `executor` and `metrics` outlive the service.
  AttentionService(Engine* engine, Executor* executor, ServiceMetrics* metrics,
                   ServiceOptions options);

  // Refuse new sequences and steps with UNAVAILABLE; open steps may finish.
  void SetDraining() { draining_ = true; }
  bool draining() const { return draining_; }
  // ServerInfo.replica_name (set once the port is bound, before readiness).
  void SetReplicaName(std::string name);
  // The KV-event publisher (ServerInfo names its endpoint); set once, before readiness.
  void SetKvEvents(const KvEventPublisher* events) { kv_events_ = events; }
  // Standby replicas (docs/replication.md): commits wait for it as its mode says, opens and
  // closes reach it. Set once, before readiness; null: no replication.
  void SetReplicator(ReplicationHook* replicator) { replicator_ = replicator; }

  grpc::ServerUnaryReactor* ServerInfo(grpc::CallbackServerContext* ctx,
                                       const v1::ServerInfoRequest* req,
                                       v1::ServerInfoResponse* resp) override;
  grpc::ServerUnaryReactor* OpenSequence(grpc::CallbackServerContext* ctx,
                                         const v1::OpenSequenceRequest* req,
                                         v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* LookupPrefix(grpc::CallbackServerContext* ctx,
                                         const v1::LookupPrefixRequest* req,
                                         v1::LookupPrefixResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSequence(grpc::CallbackServerContext* ctx,
                                          const v1::CloseSequenceRequest* req,
                                          v1::CloseSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* DescribeSequence(grpc::CallbackServerContext* ctx,
                                             const v1::DescribeSequenceRequest* req,
                                             v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* PromoteSequence(grpc::CallbackServerContext* ctx,
                                            const v1::PromoteSequenceRequest* req,
                                            v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* ctx,
                                          const v1::ListSequencesRequest* req,
                                          v1::ListSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* PrefetchSequences(grpc::CallbackServerContext* ctx,
                                              const v1::PrefetchSequencesRequest* req,
                                              v1::PrefetchSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* OffloadSequences(grpc::CallbackServerContext* ctx,
                                             const v1::OffloadSequencesRequest* req,
                                             v1::OffloadSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* BeginStep(grpc::CallbackServerContext* ctx,
                                      const v1::BeginStepRequest* req,
                                      v1::BeginStepResponse* resp) override;
  grpc::ServerUnaryReactor* AttendLayer(grpc::CallbackServerContext* ctx,
                                        const v1::AttendLayerRequest* req,
                                        v1::AttendLayerResponse* resp) override;
  grpc::ServerUnaryReactor* AbortStep(grpc::CallbackServerContext* ctx,
                                      const v1::AbortStepRequest* req,
                                      v1::AbortStepResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterSharedMemoryRequest* req,
                                                 v1::RegisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
      v1::UnregisterSharedMemoryResponse* resp) override;
  grpc::ServerUnaryReactor* ConnectDataPlane(grpc::CallbackServerContext* ctx,
                                             const v1::ConnectDataPlaneRequest* req,
                                             v1::ConnectDataPlaneResponse* resp) override;
  grpc::ServerUnaryReactor* CloseDataPlane(grpc::CallbackServerContext* ctx,
                                           const v1::CloseDataPlaneRequest* req,
                                           v1::CloseDataPlaneResponse* resp) override;
  grpc::ServerWriteReactor<v1::ExportChunk>* ExportSequence(
      grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* req) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* req,
                                 v1::EchoResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;
  grpc::ServerUnaryReactor* UploadAbsorption(grpc::CallbackServerContext* ctx,
                                             const v1::UploadAbsorptionRequest* req,
                                             v1::UploadAbsorptionResponse* resp) override;
  grpc::ServerBidiReactor<v1::StepRequest, v1::StepResponse>* Step(
      grpc::CallbackServerContext* ctx) override;

  // The largest Echo reply and ExportSequence chunk that fit in a message.
  int64_t max_echo_bytes() const;
  int64_t max_export_chunk_tokens() const;
  int64_t max_attended_positions() const;
  // What one reply may hold (the message limit, max_attended_positions).
  ReplyLimits reply_limits() const;

  // Who is calling: UNAUTHENTICATED / PERMISSION_DENIED as Authenticator::Authenticate says.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx) const;

  // The RPCs' logic without the transport (the handlers, tests and fuzzers call these), for an
  // authenticated caller: every name is looked up in the caller's tenant.
  absl::Status DoServerInfo(const Caller& caller, v1::ServerInfoResponse* resp) const;
  absl::Status DoOpenSequence(const Caller& caller, const v1::OpenSequenceRequest& req,
                              v1::SequenceInfo* resp);
  absl::Status DoCloseSequence(const Caller& caller, const v1::CloseSequenceRequest& req);
  absl::Status DoLookupPrefix(const Caller& caller, const v1::LookupPrefixRequest& req,
                              v1::LookupPrefixResponse* resp) const;
  absl::Status DoDescribeSequence(const Caller& caller, const v1::DescribeSequenceRequest& req,
                                  v1::SequenceInfo* resp);
  absl::Status DoPromoteSequence(const Caller& caller, const v1::PromoteSequenceRequest& req,
                                 v1::SequenceInfo* resp);
  absl::Status DoListSequences(const Caller& caller, const v1::ListSequencesRequest& req,
                               v1::ListSequencesResponse* resp);
  // The tiers (docs/architecture.md#tiers): prefetch answers at once; offload blocks while the
  // sequences spill (the executor runs it).
  absl::Status DoPrefetchSequences(const Caller& caller, const v1::PrefetchSequencesRequest& req);
  absl::Status DoOffloadSequences(const Caller& caller, const v1::OffloadSequencesRequest& req);
  absl::Status DoRegisterSharedMemory(const Caller& caller,
                                      const v1::RegisterSharedMemoryRequest& req);
  absl::Status DoUnregisterSharedMemory(const Caller& caller,
                                        const v1::UnregisterSharedMemoryRequest& req);
  absl::Status DoEcho(const v1::EchoRequest& req, v1::EchoResponse* resp) const;
  // The data plane's handshake (service/data_plane.cc): fills `resp` and calls `finish` once, at
  // once or, for a plane that connects to its client's worker, from the plane's thread or timer.
  // Connecting to a pushing client's worker gives up after `wire_limit` (a plane it pulls from).
  void StartConnectDataPlane(const Caller& caller, const v1::ConnectDataPlaneRequest& req,
                             v1::ConnectDataPlaneResponse* resp, absl::Duration wire_limit,
                             std::function<void(absl::Status)> finish);
  // OK for the admin identity, or for anyone on an unauthenticated server; else
  // PERMISSION_DENIED "<method>: only the admin identity (--admin-tenant)<why>".
  absl::Status RequireAdmin(const Caller& caller, const char* method, const char* why) const;
  // Whether RequireAdmin lets the caller through.
  bool IsAdmin(const Caller& caller) const;
  // Whether this server runs without authentication (--auth=none): nobody has an identity.
  bool NoAuth() const;
  absl::Status DoUploadAbsorption(const Caller& caller, const v1::UploadAbsorptionRequest& req,
                                  v1::UploadAbsorptionResponse* resp);
  absl::Status DoAbortStep(const Caller& caller, const v1::AbortStepRequest& req);
  // The chunk size an export request asks for, checked (0 = the default).
  absl::StatusOr<int64_t> ExportChunkTokens(const v1::ExportSequenceRequest& req) const;
  // The caller's view of shared memory (refused when off or not on the Unix socket).
  ShmAccess ShmFor(const Caller& caller) const;
  // One layer message of an unsharded step, blocking (the executor runs it): one
  // Engine::RunLayer, which decodes the message against the step it looks up (one lookup, two
  // engine-lock acquisitions). `committed`, when given, gets the step's sequences at their new
  // lengths if this layer committed it (the replicator's hook).
  absl::Status Layer(const Caller& caller, const StepRef& step, const v1::LayerInputs& in,
                     v1::LayerOutput* out, Transport transport,
                     std::vector<LayerResult::Committed>* committed = nullptr);
  // Wraps `done` of a layer call on `step` so that a committing reply waits as the replication
  // mode says for the `committed` sequences (filled by the time `done` runs; a length of -1:
  // not known); `done` itself without standbys.
  std::function<void(absl::Status)> AfterStandby(
      const StepRef& step, v1::LayerOutput* out,
      std::shared_ptr<const std::vector<LayerResult::Committed>> committed,
      std::function<void(absl::Status)> done);

  // Shared by both transports. May block briefly (see Engine::BeginStep): call off gRPC threads.
  // `channel` != 0 binds an unsharded step to one Step stream.
  absl::StatusOr<uint64_t> Begin(const Caller& caller, const v1::BeginStepRequest& req,
                                 v1::BeginStepResponse* resp, uint64_t channel = 0);
  // Attaches another shard to a sharded step; returns the step's token count.
  absl::StatusOr<int64_t> Join(const StepRef& step, int shard);
  // Runs (or, for a sharded step, parks until every shard is in) one layer message and calls
  // `done` from the executor; `in` and `out` stay valid until then.
  void LayerAsync(const Caller& caller, const StepRef& step, const v1::LayerInputs* in,
                  v1::LayerOutput* out, Transport transport,
                  std::function<void(absl::Status)> done);
  // LayerAsync once the call's data plane transfers landed; `on_executor`: called from an
  // executor thread (its wait ended there), which then runs the layer itself.
  void LayerLanded(const Caller& caller, const StepRef& step, const v1::LayerInputs* in,
                   v1::LayerOutput* out, Transport transport,
                   std::function<void(absl::Status)> done, bool on_executor);
  // Runs `go` once every data plane transfer `in` names has landed or failed to (a plane's
  // timeout included: Region::WhenLanded), so that no executor thread waits for a client's
  // bytes: inline when none is outstanding (go(false)), else on an executor thread (go(true)).
  // A name that does not resolve is not waited for (the layer's decode reports it); a transfer
  // named twice is waited for once. attnd_data_plane_calls_waiting counts the calls waiting.
  void AfterLandings(const Caller& caller, const v1::LayerInputs& in,
                     std::function<void(bool deferred)> go);
  // Shards of a sharded step; 0 for an ordinary step.
  int NumShards(const StepRef& step) const { return shards_.NumShards(step); }
  // Aborts a step for every shard: the engine step and any parked shard messages.
  void AbortEverywhere(const StepRef& step, const absl::Status& why, AbortReason reason);
  // Aborts sharded steps whose parked messages waited longer than `idle` for another shard.
  void ReapShards(std::chrono::steady_clock::duration idle);
  // Closes the data planes whose client is gone (UcxPlane::CloseIdle), in the background.
  void CloseIdlePlanes();
  // Shutdown: answers every parked shard message (CANCELLED) so no call outlives the server.
  void FailParkedShards();
  Executor* executor() { return executor_; }
  // An RPC finished: its metrics, and a (rate-limited) log line when it failed.
  // Counts and times a finished call (`started`: when it arrived) and logs a failure.
  void Report(const char* method, const absl::Status& status,
              std::chrono::steady_clock::time_point started);
  Engine* engine() { return engine_; }
  ServiceMetrics* metrics() { return metrics_; }

 private:
  class StepStream;
  // A standby copy for another replica (OpenSequenceRequest.standby_generation).
  absl::Status OpenStandby(const Caller& caller, const v1::OpenSequenceRequest& req,
                           v1::SequenceInfo* resp);
  // FAILED_PRECONDITION when this replica's copy of `key` was fenced (it failed over).
  absl::Status FencedHere(const SequenceKey& key) const;
  // A request's lease_ms: [0, StandbyLeases::kMaxLeaseMs], nonzero from the admin identity only.
  absl::Status CheckLeaseMs(const Caller& caller, const char* what, int64_t ms) const;
  // One layer of a sharded step from every shard's message (blocking).
  absl::Status LayerSharded(const StepRef& step, const std::vector<ShardGather::Part>& parts,
                            Transport transport);
  // Runs `fn(caller)` for an authenticated caller and finishes the call with its status.
  template <typename Fn>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const char* method, Fn fn);
  // The same on the executor (or `on`), for calls that may block (tier moves): `fn` must own
  // what it uses.
  template <typename Fn>
  grpc::ServerUnaryReactor* Posted(grpc::CallbackServerContext* ctx, const char* method, Fn fn,
                                   Executor* on = nullptr);
  // The same for a call that answers later: `fn(caller, finish)` calls `finish` once, on any
  // thread (an exception before it answers with the exception's status).
  template <typename Fn>
  grpc::ServerUnaryReactor* PostedAsync(grpc::CallbackServerContext* ctx, const char* method, Fn fn,
                                        Executor* on = nullptr);
  ServiceOptions options_;
  ShardGather shards_;
  ShmRegistry shm_;
  // An UploadAbsorption in progress: the layers received so far (handed to the engine when the
  // last one is in).
  std::mutex upload_mu_;
  std::unique_ptr<Absorption> upload_;
  Engine* engine_;
  Executor* executor_;
  StandbyLeases leases_;  // the leases this replica granted its peers on their standby copies
  ServiceMetrics* metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<const KvEventPublisher*> kv_events_{nullptr};
  ReplicationHook* replicator_ = nullptr;
  mutable std::mutex name_mu_;
  std::string replica_name_;               // guarded by name_mu_
  std::atomic<uint64_t> next_channel_{1};  // Step streams' channels
  StepLog step_log_;
  std::atomic<bool> closing_idle_planes_{false};  // a CloseIdlePlanes round is queued
  // The data plane's handshakes and closes (with the plane on): they wait on the network (a
  // client's worker being connected, up to 5 s) and on UCX threads, so never on the executor's
  // threads, which layer calls of every tenant need. Last: gone (its tasks run) before the rest.
  std::unique_ptr<Executor> plane_handshakes_;
};

}  // namespace attnd
