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
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/absorption.h"
#include "common/hf_config.h"
#include "common/status_macros.h"
#include "engine/engine.h"
#include "service/attention_service.h"
#include "service/drain.h"
#include "service/metrics.h"
#include "service/metrics_http.h"
#include "service/metrics_https.h"
#include "service/service_metrics.h"
#include "service/tls.h"
#include "service/unix_listener.h"

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

absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const ServerFlags& f) {
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

// "host:port", with an IPv6 host in brackets ("[::]:50051").
std::string HostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// The metrics listener's host: civetweb (Debian's build) and the HTTPS listener are IPv4 only.
std::string MetricsHost(const ServerFlags& f) {
  if (!f.metrics_address.empty()) return f.metrics_address;
  return f.grpc_address.find(':') == std::string::npos ? f.grpc_address : "0.0.0.0";
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

}  // namespace

int RunServer(const ServerFlags& flags) {
  // Every thread started from here on inherits the blocked signals; main waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto engine_or = MakeEngine(flags);
  if (!engine_or.ok()) {
    std::fprintf(stderr, "attnd: %s\n", std::string(engine_or.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<Engine> engine = std::move(engine_or).value();
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "attnd: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  AuthOptions ao;
  ao.mode = ParseAuthMode(flags.auth).value();  // the flag parser checked the name
  ao.tokens_file = flags.auth_tokens;
  ao.admin_tenant = flags.admin_tenant;
  auto auth_or = Authenticator::Create(ao);
  if (!auth_or.ok()) return fail(auth_or.status());
  std::shared_ptr<Authenticator> auth = std::move(auth_or).value();
  ApplyQuotas(flags, *auth, engine.get());
  const TlsFiles tls{flags.tls_cert, flags.tls_key, flags.tls_client_ca,
                     static_cast<int>(flags.reload_interval_s)};
  auto creds = MakeServerCredentials(tls);
  if (!creds.ok()) return fail(creds.status());
  const bool loopback = flags.grpc_address.rfind("127.", 0) == 0 || flags.grpc_address == "::1" ||
                        flags.grpc_address == "localhost";
  if (ao.mode == AuthMode::kToken && flags.tls_cert.empty() && !loopback)
    std::fprintf(stderr,
                 "attnd: warning: --auth=token without --tls-cert: bearer tokens cross the network "
                 "in clear text (only safe on loopback or inside an encrypting mesh)\n");
  Executor executor(flags.executor_threads);
  metrics::Registry registry;
  ServiceMetrics service_metrics(&registry, engine.get(), &executor);
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http;
  std::unique_ptr<metrics::MetricsHttpsServer> metrics_https;
  int metrics_port = 0;
  const std::string metrics_listen = absl::StrCat(MetricsHost(flags), ":", flags.metrics_port);
  if (flags.allow_metrics && flags.metrics_tls) {
    auto m = metrics::MetricsHttpsServer::Start(
        metrics_listen, &registry,
        {flags.tls_cert, flags.tls_key, static_cast<int>(flags.reload_interval_s)});
    if (!m.ok()) return fail(m.status());
    metrics_https = std::move(m).value();
    metrics_port = metrics_https->port();
  } else if (flags.allow_metrics) {
    auto m = metrics::MetricsHttpServer::Start(metrics_listen, &registry);
    if (!m.ok()) {
      std::fprintf(stderr, "attnd: metrics: %s\n", std::string(m.status().message()).c_str());
      return 1;
    }
    metrics_http = std::move(m).value();
    metrics_port = metrics_http->port();
  }

  ServiceOptions so;
  so.max_message_bytes = flags.max_message_bytes;
  so.step_idle_timeout_ms = flags.step_idle_timeout_ms;
  so.max_echo_bytes = flags.max_echo_bytes;
  so.max_shm_regions = flags.max_shm_regions;
  so.auth = auth;
  so.shm_enabled = flags.shm;
  so.shm_prefix = flags.shm_prefix;
  std::mutex drain_mu;
  std::vector<std::string> requested_peers;  // from the Drain RPC
  so.start_drain = [&](std::vector<std::string> peers) {
    {
      std::lock_guard<std::mutex> lock(drain_mu);
      requested_peers = std::move(peers);
    }
    kill(getpid(), SIGTERM);  // the same path as an operator's SIGTERM
  };
  AttentionService service(engine.get(), &executor, &service_metrics, so);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!flags.grpc_reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  int port = 0;
  const std::string address = HostPort(flags.grpc_address, flags.grpc_port);
  builder.AddListeningPort(address, *creds, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(flags.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(flags.max_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "attnd: cannot listen on %s\n", address.c_str());
    return 1;
  }
  std::unique_ptr<UnixListener> local;
  if (flags.shm) {
    auto l = UnixListener::Start(flags.shm_socket, flags.shm_socket_mode, server.get());
    if (!l.ok()) {
      server->Shutdown();
      return fail(l.status());
    }
    local = std::move(l).value();
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);

  const auto caps = engine->Capacity();
  const std::string metrics_where =
      metrics_port > 0
          ? absl::StrCat("on :", metrics_port, "/metrics", flags.metrics_tls ? " (https)" : "")
          : "off";
  std::printf(
      "attnd: serving attnd.v1 on %s; model %s (%d layers), %zu device(s) x %d pages, "
      "cpu isa %s, metrics %s\n",
      HostPort(flags.grpc_address, port).c_str(), engine->spec().name.c_str(),
      engine->spec().num_layers(), caps.size(), caps[0].pages_total, engine->cpu_isa().c_str(),
      metrics_where.c_str());
  std::printf("attnd: cache %s, %d pages x %zu B per device: %s\n",
              DTypeName(engine->options().cache_dtype), caps[0].pages_total, caps[0].bytes_per_page,
              engine->cache_sizing().c_str());
  std::printf(
      "attnd: tls %s, auth %s%s, shared memory %s, reflection %s\n",
      flags.tls_cert.empty()        ? "off"
      : flags.tls_client_ca.empty() ? "on"
                                    : "on (client certificates required)",
      flags.auth.c_str(),
      flags.admin_tenant.empty() ? "" : absl::StrCat(", admin ", flags.admin_tenant).c_str(),
      flags.shm ? absl::StrCat("on ", flags.shm_socket).c_str() : "off",
      flags.grpc_reflection ? "on" : "off");
  if (const auto a = engine->absorption())
    std::printf("attnd: absorption on (%s): q_nope [T, H, %d] in, [T, H, %d] out, %zu MB\n",
                a->source().c_str(), a->qk_nope_head_dim(), a->v_head_dim(), a->bytes() >> 20);
  std::fflush(stdout);
  LOG(INFO) << "config: devices " << absl::StrJoin(engine->options().devices, ",") << ", model "
            << engine->spec().name << ", cache " << DTypeName(engine->options().cache_dtype) << " "
            << caps[0].pages_total << " pages x " << caps[0].bytes_per_page << " B per device ("
            << engine->cache_sizing() << "), threads " << engine->options().threads
            << ", max message " << flags.max_message_bytes << " B, step idle timeout "
            << flags.step_idle_timeout_ms << " ms; limits: step tokens " << flags.max_step_tokens
            << ", batch " << flags.max_batch_entries << ", sequences " << flags.max_sequences
            << "; tenant quotas (0 = none): pages " << flags.quota_pages << ", sequences "
            << flags.quota_sequences << ", steps " << flags.quota_steps << ", shm regions "
            << flags.quota_shm_regions << "; auth " << flags.auth << ", tls "
            << (flags.tls_cert.empty() ? "off" : "on") << ", shm " << (flags.shm ? "on" : "off")
            << "; drain peers "
            << (flags.drain_peers.empty() ? "none" : absl::StrJoin(flags.drain_peers, ","))
            << " (timeout " << flags.drain_timeout_ms << " ms, " << flags.drain_parallel
            << " at once)";

  // Idle steps expire in the background.
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  const auto idle = std::chrono::milliseconds(flags.step_idle_timeout_ms);
  // Idle steps expire, and the token file is reread when it changes, in the background.
  std::thread reaper([&] {
    std::unique_lock<std::mutex> lock(mu);
    const auto period = std::clamp<std::chrono::milliseconds>(
        idle / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
    const auto wait = flags.step_idle_timeout_ms > 0 ? period : std::chrono::milliseconds(1000);
    const auto reload_every = std::chrono::seconds(flags.reload_interval_s);
    auto next_reload = std::chrono::steady_clock::now() + reload_every;
    while (!cv.wait_for(lock, wait, [&] { return stopping; })) {
      if (std::chrono::steady_clock::now() >= next_reload) {
        next_reload += reload_every;
        const absl::StatusOr<bool> reloaded = auth->ReloadIfChanged();
        if (!reloaded.ok()) {
          LOG(WARNING) << "token file not reloaded (the old tokens stay): "
                       << reloaded.status().message();
        } else if (*reloaded) {
          ApplyQuotas(flags, *auth, engine.get());
          LOG(INFO) << "token file reloaded";
        }
      }
      if (flags.step_idle_timeout_ms <= 0) continue;
      if (const int n = engine->ExpireIdleSteps(idle); n > 0)
        LOG(WARNING) << n << " idle step(s) expired after " << flags.step_idle_timeout_ms
                     << " ms and were aborted (their sequences are as before them)";
      service.ReapShards(idle);
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("attnd: %s received, draining\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  service.SetDraining();
  health->SetServingStatus(kServiceName, false);
  {
    std::vector<std::string> peers = flags.drain_peers;
    {
      std::lock_guard<std::mutex> lock(drain_mu);
      if (!requested_peers.empty()) peers = requested_peers;
    }
    if (!peers.empty()) {
      auto d = MakeDrainOptions(flags, peers);
      if (!d.ok()) {
        std::fprintf(stderr, "attnd: drain: %s\n", std::string(d.status().message()).c_str());
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        const DrainReport r = DrainSequences(*engine, *d);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        std::printf(
            "attnd: drained: %d sequence(s) handed to %zu peer(s), %d left behind in %.0f ms%s%s\n",
            r.moved, r.peers.size(), r.failed, ms, r.first_error.empty() ? "" : ": ",
            r.first_error.c_str());
      }
    } else if (engine->num_sequences() > 0) {
      std::printf("attnd: no --drain-peers: %lld sequence(s) are dropped at exit\n",
                  static_cast<long long>(engine->num_sequences()));
    }
    std::fflush(stdout);
  }
  local.reset();  // no new local connections (those open finish with the others)
  // Shard messages parked for a shard that never comes would keep Shutdown waiting forever:
  // when the grace period ends, answer them.
  std::mutex grace_mu;
  std::condition_variable grace_cv;
  bool shut = false;
  std::thread grace([&] {
    std::unique_lock<std::mutex> lock(grace_mu);
    if (!grace_cv.wait_for(lock, std::chrono::milliseconds(flags.shutdown_grace_ms),
                           [&] { return shut; }))
      service.FailParkedShards();
  });
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(flags.shutdown_grace_ms));
  server->Wait();
  {
    std::lock_guard<std::mutex> lock(grace_mu);
    shut = true;
  }
  grace_cv.notify_all();
  grace.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  reaper.join();
  const int aborted = engine->ExpireIdleSteps(std::chrono::milliseconds(0));
  std::printf("attnd: stopped (%d open step(s) aborted at exit)\n", aborted);
  return 0;
}

}  // namespace attnd
