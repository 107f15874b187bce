#include "service/server.h"

#include <glog/logging.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/drain.h"
#include "cluster/replication.h"
#include "common/absorption.h"
#include "common/hf_config.h"
#include "common/status_macros.h"
#include "engine/engine.h"
#include "grpc/health/v1/health.pb.h"
#include "metrics/metrics.h"
#include "metrics/metrics_http.h"
#include "service/attention_service.h"
#include "service/kv_events.h"
#include "service/logging.h"
#include "service/service_metrics.h"
#include "service/tls.h"
#include "service/unix_listener.h"
#include "transport/ucx_log.h"
#include "transport/ucx_plane.h"

namespace attnd {
namespace {

constexpr char kServiceName[] = "attnd.v1.Attention";

absl::StatusOr<ModelSpec> LoadSpec(const ServerFlags& f) {
  const std::string& path = f.hf_config.empty() ? f.model_file : f.hf_config;
  if (path.empty()) return PresetModelSpec(f.model);
  const char* flag = f.hf_config.empty() ? "--model-file" : "--hf-config";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return f.hf_config.empty() ? ParseModelSpecJson(text.str()) : SpecFromHfConfig(text.str());
}

TenantQuota FlagQuota(const ServerFlags& f) {
  TenantQuota q;
  q.pages = f.quota_pages;
  q.sequences = f.quota_sequences;
  q.open_steps = f.quota_steps;
  q.shm_regions = f.quota_shm_regions;
  return q;
}

// The token file's per-tenant quotas over the flags' (at start and after each reload).
void ApplyQuotas(const ServerFlags& f, const Authenticator& auth, Engine* engine) {
  const TenantQuota fallback = FlagQuota(f);
  engine->SetTenantQuotas(fallback, auth.QuotaOverrides(fallback));
}

// The disk tier's page file: one per replica sharing the directory, named for it (--replica-name,
// else the port), so a restarted replica removes its predecessor's file; with an ephemeral port
// (tests), the process id.
std::string DiskFileName(const ServerFlags& f) {
  std::string name = !f.replica_name.empty() ? f.replica_name
                     : f.grpc_port > 0       ? absl::StrCat("port", f.grpc_port)
                                             : absl::StrCat("pid", getpid());
  for (char& c : name)
    if (c == ':' || c == '/') c = '_';
  return absl::StrCat("attnd-", name, ".pages");
}

absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(
    const ServerFlags& f, std::function<void(const TierEvent&)> on_tier_event,
    std::function<void(const PrefixEvent&)> on_prefix_event) {
  EngineOptions o;
  ASSIGN_OR_RETURN(o.spec, LoadSpec(f));
  o.devices = f.devices;  // "cpu:N" / "cuda:N", validated by the engine
  if (o.devices.size() == 1 && o.devices[0] == "auto") {
    ASSIGN_OR_RETURN(o.devices, Engine::DefaultDevices());
  }
  o.cache_dtype = f.cache_dtype;
  o.pages_per_device = f.kv_pages;
  o.cache_bytes_per_device = static_cast<size_t>(f.kv_cache_bytes);
  o.cache_fraction = f.kv_cache_fraction;
  o.device.gpu_scratch_bytes = static_cast<size_t>(f.gpu_scratch_bytes);
  o.threads = f.threads;
  o.limits.max_step_tokens = f.max_step_tokens;
  o.limits.max_batch_entries = f.max_batch_entries;
  o.limits.max_sequences = f.max_sequences;
  o.limits.max_id_bytes = static_cast<size_t>(f.max_id_bytes);
  o.limits.check_finite = f.check_finite;
  o.limits.abort_wait = std::chrono::milliseconds(f.begin_wait_ms);
  o.limits.tenant_quota = FlagQuota(f);
  o.device.cpu_isa = f.cpu_isa;
  o.device.cuda_mla = f.cuda_mla;
  o.device.cuda_indexer = f.cuda_indexer;
  o.device.cuda_topk = f.cuda_topk;
  o.tiers.host_bytes = static_cast<size_t>(f.host_cache_bytes);
  o.tiers.disk_dir = f.disk_cache_dir;
  o.tiers.disk_bytes = static_cast<size_t>(f.disk_cache_bytes);
  o.tiers.disk_file = DiskFileName(f);
  o.on_tier_event = std::move(on_tier_event);
  o.prefix_cache_bytes = f.prefix_cache_bytes;
  o.standby_cache_bytes = f.standby_cache_bytes;
  o.on_prefix_event = std::move(on_prefix_event);
  if (!f.absorb_from.empty()) {
    auto absorb = LoadAbsorption(f.absorb_from, o.spec);
    if (!absorb.ok())
      return absl::Status(absorb.status().code(),
                          absl::StrCat("--absorb-from: ", absorb.status().message()));
    o.absorption = *std::move(absorb);
  }
  return Engine::Create(o);
}

absl::StatusOr<DrainOptions> MakeDrainOptions(const ServerFlags& f,
                                              std::vector<std::string> peers) {
  DrainOptions d;
  d.peers = std::move(peers);
  d.timeout = std::chrono::milliseconds(f.drain_timeout_ms);
  d.parallel = static_cast<int>(f.drain_parallel);  // 1-64 (flags.cc)
  d.credentials.tls_ca_file = f.drain_tls_ca;
  d.credentials.tls_cert_file = f.drain_tls_cert;
  d.credentials.tls_key_file = f.drain_tls_key;
  if (!f.drain_token_file.empty()) {
    auto token = client::ReadTokenFile(f.drain_token_file);
    if (!token.ok())
      return absl::NotFoundError(absl::StrCat("--drain-token-file: ", token.status().message()));
    d.credentials.token = *std::move(token);
  }
  return d;
}

// The replica name without --replica-name: this host's name and the bound port (a StatefulSet
// pod's name is its host name and every pod has the same port: stable across restarts; two
// servers on one host differ).
std::string DefaultReplicaName(int port) {
  char host[256] = "";
  if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0')
    std::snprintf(host, sizeof(host), "localhost");
  return absl::StrCat(host, ":", port);
}

// "host:port", with an IPv6 host in brackets ("[::]:50051").
std::string HostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// The metrics listener's host: --metrics-address, else the gRPC address's (IPv4, IPv6 or a name).
std::string MetricsHost(const ServerFlags& f) {
  return f.metrics_address.empty() ? f.grpc_address : f.metrics_address;
}

// Drops gRPC's reflection plugin from a builder: linking grpc++_reflection registers it for every
// server at static initialisation, so --grpc-reflection=false has to take it out again.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(
        std::remove_if(plugins->begin(), plugins->end(),
                       [](const auto& p) { return p->name() == "proto_server_reflection"; }),
        plugins->end());
  }
};

// One server's life, in the order RunServer takes its steps.
class Server {
 public:
  explicit Server(const ServerFlags& flags) : flags_(flags) {}
  ~Server() {
    if (grpc_server_) grpc_server_->Shutdown();
    std::lock_guard<std::mutex> lock(tier_mu_);
    tier_metrics_ = nullptr;
  }

  // The engine, authentication and the metrics listener; then the gRPC server and the local
  // (shared-memory) listener, serving.
  absl::Status Start() {
    // Tier moves reach the metrics and the log (the metrics exist once the engine does).
    // Prefix-cache blocks reach the KV-event publisher once it exists (BuildServer: it names the
    // replica in every message).
    ASSIGN_OR_RETURN(engine_, MakeEngine(
                                  flags_, [this](const TierEvent& e) { TierMoved(e); },
                                  [this](const PrefixEvent& e) {
                                    std::lock_guard<std::mutex> lock(events_mu_);
                                    if (events_ != nullptr) events_->Publish(e);
                                  }));
    RETURN_IF_ERROR(StartAuth());
    executor_ = std::make_unique<Executor>(flags_.executor_threads);
    service_metrics_ = std::make_unique<ServiceMetrics>(&registry_, engine_.get(), executor_.get());
    {
      std::lock_guard<std::mutex> lock(tier_mu_);
      tier_metrics_ = service_metrics_.get();
    }
    if (absl::Status st = StartMetrics(); !st.ok())
      return absl::Status(st.code(), absl::StrCat("metrics: ", st.message()));
    RETURN_IF_ERROR(BuildServer());
    SayServing();
    return absl::OkStatus();
  }

  // Idle steps expire, shard messages nobody claims are dropped, data planes whose client is
  // gone close and the token file is reread when it changes, in the background, until ShutDown.
  void StartHousekeeping() {
    housekeeping_ = std::thread([this] { Housekeeping(); });
  }

  // Waits for SIGTERM or SIGINT (the Drain RPC raises SIGTERM), then turns NOT_SERVING, refuses
  // new work and hands every sequence to the drain peers (the Drain call's or the flag's).
  void AwaitSignalAndDrain(const sigset_t& signals) {
    int sig = 0;
    sigwait(&signals, &sig);
    Say(absl::StrCat(sig == SIGTERM ? "SIGTERM" : "SIGINT", " received, draining"));
    service_->SetDraining();
    grpc_server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
    // Without --drain-peers a drain goes to the standby peers (where the copies are).
    std::vector<std::string> peers =
        flags_.drain_peers.empty() ? flags_.standby_peers : flags_.drain_peers;
    {
      std::lock_guard<std::mutex> lock(drain_mu_);
      if (!requested_peers_.empty()) peers = requested_peers_;
    }
    if (!peers.empty()) {
      Drain(peers);
      return;
    }
    // No peers: the same window for open steps to finish, listener open and NOT_SERVING, then
    // the sequences go with the process.
    const int64_t left =
        AwaitOpenSteps(*engine_, std::chrono::steady_clock::now() +
                                     std::chrono::milliseconds(flags_.drain_timeout_ms));
    if (left > 0)
      Say(absl::StrCat(left, " step(s) still open after --drain-timeout-ms=",
                       flags_.drain_timeout_ms, " are aborted at exit"));
    if (engine_->num_sequences() > 0)
      Say(absl::StrCat("no --drain-peers: ", engine_->num_sequences(),
                       " sequence(s) are dropped at exit"));
  }

  // Stops listening, lets open calls finish for --shutdown-grace-ms (then answers parked shard
  // messages), stops the housekeeping and aborts the steps still open. The exit code.
  int ShutDown() {
    local_.reset();  // no new local connections (those open finish with the others)
    // Shard messages parked for a shard that never comes would keep Shutdown waiting forever:
    // when the grace period ends, answer them.
    std::mutex grace_mu;
    std::condition_variable grace_cv;
    bool shut = false;
    std::thread grace([&] {
      std::unique_lock<std::mutex> lock(grace_mu);
      if (!grace_cv.wait_for(lock, std::chrono::milliseconds(flags_.shutdown_grace_ms),
                             [&] { return shut; }))
        service_->FailParkedShards();
    });
    grpc_server_->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(flags_.shutdown_grace_ms));
    grpc_server_->Wait();
    grpc_server_.reset();
    // The metrics endpoint reads the replicator, the data plane and the engine through raw
    // pointers: it stops before any of them goes (a scrape during exit read them freed).
    metrics_http_.reset();
    replicator_.reset();  // no call waits on it any more
    {
      std::lock_guard<std::mutex> lock(grace_mu);
      shut = true;
    }
    grace_cv.notify_all();
    grace.join();
    {
      std::lock_guard<std::mutex> lock(housekeeping_mu_);
      stopping_ = true;
    }
    housekeeping_cv_.notify_all();
    if (housekeeping_.joinable()) housekeeping_.join();
    const int aborted = engine_->ExpireIdleSteps(std::chrono::milliseconds(0));
    Say(absl::StrCat("stopped (", aborted, " open step(s) aborted at exit)"));
    return 0;
  }

 private:
  // Whether gRPC listens on loopback only (--grpc-address 127.x, ::1 or localhost).
  bool ListensOnLoopback() const {
    return flags_.grpc_address.rfind("127.", 0) == 0 || flags_.grpc_address == "::1" ||
           flags_.grpc_address == "localhost";
  }

  // The network devices of the data plane's workers where UCX_NET_DEVICES names none: loopback
  // for a server reachable there only, else UCX's choice ("").
  std::string DataPlaneDevices() const {
    return ListensOnLoopback() ? transport::LoopbackDevices() : "";
  }

  absl::Status StartAuth() {
    AuthOptions ao;
    ao.mode = ParseAuthMode(flags_.auth).value();  // the flag parser checked the name
    ao.tokens_file = flags_.auth_tokens;
    ao.admin_tenant = flags_.admin_tenant;
    ao.admin_token_file = flags_.admin_token_file;
    ASSIGN_OR_RETURN(auth_, Authenticator::Create(ao));
    ApplyQuotas(flags_, *auth_, engine_.get());
    const bool loopback = ListensOnLoopback();
    if (!ao.admin_token_file.empty() && flags_.tls_cert.empty() && !loopback)
      LOG(WARNING) << "--admin-token-file without --tls-cert: the admin token crosses the network "
                      "in clear text (only safe inside an encrypting mesh)";
    if (ao.mode == AuthMode::kToken && flags_.tls_cert.empty() && !loopback)
      LOG(WARNING) << "--auth=token without --tls-cert: bearer tokens cross the network in clear "
                      "text (only safe on loopback or inside an encrypting mesh)";
    if (flags_.data_plane == "ucx")
      LOG(WARNING) << "--data-plane=ucx: UCX trusts its peers, and a peer that speaks its wire "
                      "protocol directly can write this server's memory below attnd's checks "
                      "(docs/trust.md): run the plane only where every host that can reach it "
                      "is trusted";
    return absl::OkStatus();
  }

  absl::Status StartMetrics() {
    if (!flags_.allow_metrics) return absl::OkStatus();
    metrics_host_ = MetricsHost(flags_);
    std::function<bool(SSL_CTX&)> tls;
    if (flags_.metrics_tls) {
      ASSIGN_OR_RETURN(metrics_certificate_,
                       RotatingCertificate::Load({flags_.tls_cert, flags_.tls_key, "",
                                                  static_cast<int>(flags_.reload_interval_s)}));
      tls = [c = metrics_certificate_.get()](SSL_CTX& ctx) { return c->InstallOn(ctx); };
    }
    ASSIGN_OR_RETURN(metrics_http_, metrics::MetricsHttpServer::Start(
                                        metrics_host_, flags_.metrics_port, &registry_, tls));
    metrics_port_ = metrics_http_->port();
    return absl::OkStatus();
  }

  absl::Status BuildServer() {
    const TlsFiles tls{flags_.tls_cert, flags_.tls_key, flags_.tls_client_ca,
                       static_cast<int>(flags_.reload_interval_s)};
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> creds, MakeServerCredentials(tls));
    ServiceOptions so;
    so.max_message_bytes = flags_.max_message_bytes;
    so.step_idle_timeout_ms = flags_.step_idle_timeout_ms;
    so.max_echo_bytes = flags_.max_echo_bytes;
    so.max_shm_regions = flags_.max_shm_regions;
    so.auth = auth_;
    so.shm_enabled = flags_.shm;
    so.shm_prefix = flags_.shm_prefix;
    if (flags_.data_plane == "ucx") {
      transport::UcxPlane::Options po;
      po.max_planes = flags_.data_plane_max_planes;
      po.max_region_bytes = flags_.data_plane_region_bytes;
      po.transfer_timeout = absl::Milliseconds(flags_.data_plane_timeout_ms);
      po.push = flags_.data_plane_push;
      po.keepalive = absl::Milliseconds(flags_.data_plane_keepalive_ms);
      // UCX's own lines into this log, bounded, rather than plain text on stdout
      // (transport/ucx_log.h); UCX_LOG_FILE keeps UCX's printer.
      transport::RouteUcxLogs([](transport::UcxLogLevel level, const std::string& line) {
        if (level == transport::UcxLogLevel::kError)
          LOG(ERROR) << line;
        else if (level == transport::UcxLogLevel::kWarning)
          LOG(WARNING) << line;
        else
          LOG(INFO) << line;
      });
      // A server reachable on loopback only keeps UCX's network transports there too.
      po.devices = DataPlaneDevices();
      ASSIGN_OR_RETURN(so.data_plane, transport::UcxPlane::Create(po));
    }
    so.drain_peers = flags_.drain_peers;
    so.start_drain = [this](std::vector<std::string> peers) {
      {
        std::lock_guard<std::mutex> lock(drain_mu_);
        requested_peers_ = std::move(peers);
      }
      kill(getpid(), SIGTERM);  // the same path as an operator's SIGTERM
    };
    service_metrics_->SetDataPlane(so.data_plane.get());
    service_ = std::make_unique<AttentionService>(engine_.get(), executor_.get(),
                                                  service_metrics_.get(), so);

    grpc::EnableDefaultHealthCheckService(true);
    // gRPC serves health without a protobuf descriptor; naming ours here links it in, so
    // reflection describes grpc.health.v1.Health (grpcurl ... grpc.health.v1.Health/Check).
    (void)grpc::health::v1::HealthCheckRequest::descriptor();
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    if (!flags_.grpc_reflection) builder.SetOption(std::make_unique<WithoutReflection>());
    const std::string address = HostPort(flags_.grpc_address, flags_.grpc_port);
    // gRPC shares a port by default (SO_REUSEPORT): a second attnd would silently take half the
    // connections, and half the calls would find no sequence.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, flags_.reuse_grpc_port ? 1 : 0);
    // Keepalive: a worker that vanished without a FIN (a node lost) is found within time +
    // timeout, and workers' own keepalive pings (idle between steps) are welcome.
    constexpr int kNever = std::numeric_limits<int>::max();
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               flags_.keepalive_time_ms > 0 ? flags_.keepalive_time_ms : kNever);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, flags_.keepalive_timeout_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                               flags_.keepalive_min_client_interval_ms);
    if (flags_.max_connection_age_ms > 0) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, flags_.max_connection_age_ms);
      builder.AddChannelArgument(
          GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
          flags_.max_connection_age_grace_ms > 0 ? flags_.max_connection_age_grace_ms : kNever);
    }
    builder.AddListeningPort(address, creds, &port_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(flags_.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(flags_.max_message_bytes));
    builder.RegisterService(service_.get());
    grpc_server_ = builder.BuildAndStart();
    if (!grpc_server_ || port_ == 0)
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", address, " (port ", flags_.grpc_port,
                       " in use by another process? --reuse-grpc-port shares it on purpose)"));
    if (flags_.shm) {
      ASSIGN_OR_RETURN(local_, UnixListener::Start(flags_.shm_socket, flags_.shm_socket_mode,
                                                   grpc_server_.get()));
    }
    replica_name_ = flags_.replica_name.empty() ? DefaultReplicaName(port_) : flags_.replica_name;
    service_->SetReplicaName(replica_name_);
    if (!flags_.kv_events.empty()) {
      KvEventsOptions ko;
      ko.endpoint = flags_.kv_events;
      ko.replay_endpoint = flags_.kv_events_replay;
      ko.replay_bytes = flags_.kv_events_replay_bytes;
      ko.array_form = flags_.kv_events_format == "array";
      ko.replica = replica_name_;
      ko.block_size = engine_->spec().page_size;
      for (const DeviceCapacity& d : engine_->Capacity())
        ko.device_medium.push_back(d.backend == "cuda" ? "GPU" : "CPU");
      ASSIGN_OR_RETURN(auto events, KvEventPublisher::Create(ko));
      service_->SetKvEvents(events.get());
      service_metrics_->SetKvEvents(events.get());
      std::lock_guard<std::mutex> lock(events_mu_);
      events_ = std::move(events);
    }
    if (!flags_.standby_peers.empty()) {
      ASSIGN_OR_RETURN(DrainOptions peers, MakeDrainOptions(flags_, {}));
      ReplicationOptions ro;
      ro.mode = flags_.replication == "sync" ? ReplicationOptions::Mode::kSync
                                             : ReplicationOptions::Mode::kAsync;
      ro.peers = flags_.standby_peers;
      ro.self_name = replica_name_;
      ro.credentials = peers.credentials;
      ro.max_lag_steps = flags_.replication_max_lag_steps;
      ro.ack_timeout = std::chrono::milliseconds(flags_.replication_ack_timeout_ms);
      ro.lease = std::chrono::milliseconds(flags_.replication_lease_ms);
      ro.chunk_tokens = std::min<int64_t>(4096, service_->max_export_chunk_tokens());
      ro.max_batch_entries = std::min<int64_t>(64, flags_.max_batch_entries);
      auto r = Replicator::Create(engine_.get(), std::move(ro));
      if (!r.ok())
        return absl::Status(r.status().code(),
                            absl::StrCat("--standby-peers: ", r.status().message()));
      replicator_ = *std::move(r);
      service_->SetReplicator(replicator_.get());
      service_metrics_->SetReplicator(replicator_.get());
    }
    grpc::HealthCheckServiceInterface* health = grpc_server_->GetHealthCheckService();
    health->SetServingStatus("", true);
    health->SetServingStatus(kServiceName, true);
    return absl::OkStatus();
  }

  // The serving line (first, for tools that read the port), the cache, security and absorption
  // lines, and the effective configuration in the log.
  void SayServing() const {
    const auto caps = engine_->Capacity();
    const ModelSpec& spec = engine_->spec();
    const EngineOptions& eo = engine_->options();
    const std::string metrics_where =
        metrics_port_ > 0 ? absl::StrCat("on ", HostPort(metrics_host_, metrics_port_), "/metrics",
                                         flags_.metrics_tls ? " (https)" : "")
                          : "off";
    Say(absl::StrCat("serving attnd.v1 on ", HostPort(flags_.grpc_address, port_), " as replica ",
                     replica_name_, "; model ", spec.name, " (", spec.num_layers(), " layers), ",
                     caps.size(), " device(s) x ", caps[0].pages_total, " pages, cpu isa ",
                     engine_->cpu_isa(), ", metrics ", metrics_where));
    Say(absl::StrCat("cache ", DTypeName(eo.cache_dtype), ", ", caps[0].pages_total, " pages x ",
                     caps[0].bytes_per_page, " B per device: ", engine_->cache_sizing()));
    Say(absl::StrCat(
        "tls ",
        flags_.tls_cert.empty()        ? "off"
        : flags_.tls_client_ca.empty() ? "on"
                                       : "on (client certificates required)",
        ", auth ", flags_.auth,
        flags_.admin_tenant.empty() ? "" : absl::StrCat(", admin ", flags_.admin_tenant),
        ", shared memory ", flags_.shm ? absl::StrCat("on ", flags_.shm_socket) : "off",
        ", data plane ",
        flags_.data_plane == "ucx"
            ? absl::StrCat("ucx (UCX ", transport::UcxVersion(), ", transports ",
                           transport::UcxTransports(), ", network devices ",
                           transport::UcxNetDevices(DataPlaneDevices()),
                           flags_.data_plane_push ? ", outputs pushed" : "", ")")
            : "off",
        ", reflection ", flags_.grpc_reflection ? "on" : "off"));
    std::string tiers;
    for (const TierCapacity& t : engine_->Tiers())
      if (t.enabled)
        absl::StrAppend(&tiers, tiers.empty() ? "" : ", ", TierName(t.tier), " ", t.pages_total,
                        " pages", t.where.empty() ? "" : absl::StrCat(" in ", t.where));
    if (!tiers.empty()) Say(absl::StrCat("tiers below the devices: ", tiers));
    Say(absl::StrCat("prefix cache ",
                     flags_.prefix_cache_bytes < 0 ? std::string("all")
                                                   : absl::StrCat(flags_.prefix_cache_bytes, " B"),
                     ", kv events ", events_ != nullptr ? events_->endpoint() : "off"));
    if (const auto a = engine_->absorption())
      Say(absl::StrCat("absorption on (", a->source(), "): q_nope [T, H, ", a->qk_nope_head_dim(),
                       "] in, [T, H, ", a->v_head_dim(), "] out, ", a->bytes() >> 20, " MB"));
    const ServerFlags& f = flags_;
    // The rest of the configuration (the lines above said the cache and the trust settings).
    LOG(INFO) << "config: devices " << absl::StrJoin(eo.devices, ",") << ", model " << spec.name
              << ", threads " << eo.threads << ", max message " << f.max_message_bytes
              << " B, step idle timeout " << f.step_idle_timeout_ms << " ms; keepalive "
              << f.keepalive_time_ms << "/" << f.keepalive_timeout_ms << " ms (clients every "
              << f.keepalive_min_client_interval_ms << " ms), max connection age "
              << (f.max_connection_age_ms > 0 ? absl::StrCat(f.max_connection_age_ms, " ms")
                                              : std::string("none"))
              << "; limits: step tokens " << f.max_step_tokens << ", batch " << f.max_batch_entries
              << ", sequences " << f.max_sequences << "; tenant quotas (0 = none): pages "
              << f.quota_pages << ", sequences " << f.quota_sequences << ", steps " << f.quota_steps
              << ", shm regions " << f.quota_shm_regions << "; drain peers "
              << (f.drain_peers.empty() ? "none" : absl::StrJoin(f.drain_peers, ","))
              << " (timeout " << f.drain_timeout_ms << " ms, " << f.drain_parallel << " at once)"
              << "; standby peers "
              << (f.standby_peers.empty()
                      ? std::string("none")
                      : absl::StrCat(absl::StrJoin(f.standby_peers, ","), " (", f.replication,
                                     ", max lag ", f.replication_max_lag_steps,
                                     " steps, ack timeout ", f.replication_ack_timeout_ms,
                                     " ms, lease ", f.replication_lease_ms, " ms, standby budget ",
                                     f.standby_cache_bytes < 0
                                         ? std::string("all")
                                         : absl::StrCat(f.standby_cache_bytes, " B"),
                                     ")"));
  }

  void TierMoved(const TierEvent& e) {
    {
      std::lock_guard<std::mutex> lock(tier_mu_);
      if (tier_metrics_ != nullptr) tier_metrics_->TierMoved(e);
    }
    if (e.kind == TierEvent::Kind::kDataLoss) {
      LOG(ERROR) << "data loss: sequence '" << e.sequence << "'"
                 << (e.tenant.empty() ? "" : " of tenant '" + e.tenant + "'")
                 << " lost its cached pages (a disk tier read failed or its checksum did not "
                    "match); its next use is DATA_LOSS: "
                 << e.detail;
    } else {
      VLOG(1) << (e.kind == TierEvent::Kind::kSpill ? "spilled " : "restored ")
              << (e.sequence.empty() ? "pages" : "'" + e.sequence + "'") << " " << TierName(e.from)
              << " -> " << TierName(e.to) << " (" << e.pages << " pages, "
              << TierReasonName(e.reason) << ") in " << e.seconds * 1e3 << " ms";
    }
  }

  void Housekeeping() {
    const int64_t idle_ms = flags_.step_idle_timeout_ms;
    const auto idle = std::chrono::milliseconds(idle_ms);
    const auto wait =
        idle_ms > 0 ? std::clamp<std::chrono::milliseconds>(idle / 4, std::chrono::milliseconds(10),
                                                            std::chrono::milliseconds(1000))
                    : std::chrono::milliseconds(1000);
    const auto reload_every = std::chrono::seconds(flags_.reload_interval_s);
    auto next_reload = std::chrono::steady_clock::now() + reload_every;
    std::unique_lock<std::mutex> lock(housekeeping_mu_);
    while (!housekeeping_cv_.wait_for(lock, wait, [&] { return stopping_; })) {
      if (std::chrono::steady_clock::now() >= next_reload) {
        next_reload += reload_every;
        const absl::StatusOr<bool> reloaded = auth_->ReloadIfChanged();
        if (!reloaded.ok()) {
          LOG(WARNING) << "token file not reloaded (the old tokens stay): "
                       << reloaded.status().message();
        } else if (*reloaded) {
          ApplyQuotas(flags_, *auth_, engine_.get());
          LOG(INFO) << "token file reloaded";
        }
      }
      if (flags_.sequence_idle_timeout_s > 0)
        if (const int n =
                engine_->ExpireIdleSequences(std::chrono::seconds(flags_.sequence_idle_timeout_s));
            n > 0)
          LOG(WARNING) << n << " sequence(s) closed: no step for longer than "
                       << flags_.sequence_idle_timeout_s << " s (--sequence-idle-timeout-s)";
      if (flags_.spill_idle_ms > 0)
        if (const int n =
                engine_->SpillIdleSequences(std::chrono::milliseconds(flags_.spill_idle_ms));
            n > 0)
          VLOG(1) << n << " idle sequence(s) spilled (--spill-idle-ms)";
      service_->CloseIdlePlanes();
      if (idle_ms <= 0) continue;
      if (const int n = engine_->ExpireIdleSteps(idle); n > 0)
        LOG(WARNING) << n << " idle step(s) expired after " << idle_ms
                     << " ms and were aborted (their sequences are as before them)";
      service_->ReapShards(idle);
    }
  }

  void Drain(const std::vector<std::string>& peers) {
    auto d = MakeDrainOptions(flags_, peers);
    if (!d.ok()) {
      LOG(ERROR) << "drain: " << d.status().message();
      return;
    }
    d->self_name = replica_name_;
    d->replicator = replicator_.get();
    const auto t0 = std::chrono::steady_clock::now();
    const DrainReport r = DrainSequences(*engine_, *d);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    Say(absl::StrCat("drained: ", r.moved, " sequence(s) handed to ", r.peers.size(), " peer(s), ",
                     r.failed, " left behind in ", std::llround(ms), " ms",
                     r.first_error.empty() ? "" : ": ", r.first_error));
  }

  const ServerFlags& flags_;
  // The KV-event publisher (--kv-events), outliving the engine that feeds it.
  std::mutex events_mu_;
  std::unique_ptr<KvEventPublisher> events_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<Authenticator> auth_;
  std::unique_ptr<Executor> executor_;
  metrics::Registry registry_;
  std::unique_ptr<ServiceMetrics> service_metrics_;
  // Where tier moves are counted: set once service_metrics_ exists, cleared before it goes (the
  // engine's prefetch worker may report a move until the engine is gone).
  std::mutex tier_mu_;
  ServiceMetrics* tier_metrics_ = nullptr;
  std::unique_ptr<RotatingCertificate> metrics_certificate_;  // outlives metrics_http_
  std::string metrics_host_;
  int metrics_port_ = 0;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
  std::unique_ptr<UnixListener> local_;
  std::unique_ptr<Replicator> replicator_;  // --standby-peers
  // Last, so it stops first however the server goes: it reads the engine, the service's data
  // plane and the replicator above through raw pointers.
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http_;

  std::mutex drain_mu_;
  std::vector<std::string> requested_peers_;  // from the Drain RPC
  std::string replica_name_;                  // --replica-name, or HOST:PORT

  std::mutex housekeeping_mu_;
  std::condition_variable housekeeping_cv_;
  bool stopping_ = false;
  std::thread housekeeping_;
};

}  // namespace

int RunServer(const ServerFlags& flags) {
  // Every thread started from here on inherits the blocked signals; AwaitSignalAndDrain waits
  // for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  Server server(flags);
  if (const absl::Status st = server.Start(); !st.ok()) {
    LOG(ERROR) << st.message();
    return 1;
  }
  server.StartHousekeeping();
  server.AwaitSignalAndDrain(signals);
  return server.ShutDown();
}

}  // namespace attnd
