// Serves a metrics::Registry at GET /metrics over plain HTTP (civetweb), for Prometheus to scrape.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/metrics.h"

struct mg_connection;
struct mg_context;

namespace attnd::metrics {

// HTTPS for /metrics: PEM certificate chain and key files, read once at start.
struct MetricsTls {
  std::string cert;
  std::string key;
};

// An HTTP server with two civetweb worker threads. GET (or HEAD) /metrics answers 200 with
// Registry::Serialize() as `text/plain; version=0.0.4; charset=utf-8`; other methods on /metrics
// answer 405 and every other path 404. Stops (waiting for requests in progress) in the destructor.
// The registry must outlive the server. port() is thread safe.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<MetricsHttpServer> server,
//                    MetricsHttpServer::Start("0.0.0.0:9090", &registry));
class MetricsHttpServer {
 public:
  // Listens on `listen`: "HOST:PORT" with an IPv4 address or host name ("0.0.0.0:9090",
  // "127.0.0.1:9090", "localhost:9090") or a bare "PORT" (all interfaces). PORT 0 binds a free
  // port chosen by the kernel; port() tells which. IPv6 addresses are refused: Debian 12's civetweb
  // is built without IPv6. Errors: InvalidArgument for a malformed `listen` or null registry;
  // Unavailable, with civetweb's reason ("cannot bind to 127.0.0.1:9090: 98 (Address already in
  // use)"), when the server cannot start.
  // With `tls` the port speaks HTTPS (TLS 1.2 or newer) only.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, Registry* registry, std::optional<MetricsTls> tls = std::nullopt);

  // Stops listening and waits for requests in progress (civetweb's listener, which polls in
  // 2-s rounds, is woken by a connection to the port, so this takes milliseconds).
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The TCP port listened on; the kernel's choice when started with port 0.
  int port() const { return port_; }
  const MetricsTls* tls() const { return tls_ ? &*tls_ : nullptr; }

 private:
  explicit MetricsHttpServer(Registry* registry) : registry_(registry) {}

  static int HandleRequest(mg_connection* connection, void* server);
  static int LogMessage(const mg_connection* connection, const char* message);

  Registry* const registry_;
  std::optional<MetricsTls> tls_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  std::string wake_host_;  // the address the destructor connects to, to wake the listener
  // civetweb reports why it failed to start only through its log callback; collected here while
  // Start runs, then log lines go to stderr.
  std::mutex log_mu_;  // guards started_ and start_log_
  bool started_ = false;
  std::string start_log_;
};

}  // namespace attnd::metrics
