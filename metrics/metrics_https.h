// Serves a metrics::Registry at GET /metrics over HTTPS (OpenSSL), for deployments that encrypt
// every port. civetweb's own TLS cannot be used: Debian 12's build loads OpenSSL 3 by symbol name
// and calls SSL_get_peer_certificate, a macro in OpenSSL 3, through a null pointer (civetweb issue
// #1334), so a handshake crashes the process.
//
// One connection at a time, one request per connection (Connection: close), each bounded by a
// 5-second I/O timeout and 8 KiB of request headers: a scrape endpoint, not a web server. The
// certificate files are reread when they change (checked on each connection, at most once per
// `reload_interval_s`), so rotation needs no restart.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/metrics.h"

typedef struct ssl_ctx_st SSL_CTX;

namespace attnd {
class AcceptLoop;
}

namespace attnd::metrics {

struct MetricsTlsFiles {
  std::string cert;  // PEM certificate chain
  std::string key;   // PEM private key
  int reload_interval_s = 10;
};

class MetricsHttpsServer {
 public:
  // `listen`: "HOST:PORT" (IPv4 or a name) or "PORT"; PORT 0 picks a free port (see port()).
  // INVALID_ARGUMENT for a bad address or unreadable/mismatched files; UNAVAILABLE when it cannot
  // bind.
  static absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> Start(const std::string& listen,
                                                                   Registry* registry,
                                                                   MetricsTlsFiles files);
  // Stops accepting and waits for the connection in progress.
  ~MetricsHttpsServer();
  MetricsHttpsServer(const MetricsHttpsServer&) = delete;
  MetricsHttpsServer& operator=(const MetricsHttpsServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpsServer(Registry* registry, MetricsTlsFiles files);
  void Serve(int fd);
  // A context for the current files (rebuilt when they changed); null when they are broken, in
  // which case the last good one is kept.
  SSL_CTX* Context();

  Registry* const registry_;
  const MetricsTlsFiles files_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::unique_ptr<AcceptLoop> loop_;
  SSL_CTX* ctx_ = nullptr;  // only the serving thread touches it after Start
  int64_t stamp_ = 0;       // mtimes of the files the context was built from
  int64_t checked_at_ = 0;  // steady seconds of the last check
};

}  // namespace attnd::metrics
