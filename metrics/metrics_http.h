// Serves a metrics::Registry at /metrics over HTTP or HTTPS, IPv4 and IPv6, for Prometheus to
// scrape: cpp-httplib (Debian 12: libcpp-httplib-dev) on OpenSSL.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics/metrics.h"

namespace httplib {
class Server;
}
typedef struct ssl_ctx_st SSL_CTX;

namespace attnd::metrics {

// GET or HEAD /metrics: 200 with Registry::Serialize() as `text/plain; version=0.0.4;
// charset=utf-8`; other methods 405, other paths 404. Two worker threads; each connection has 5-s
// read and write timeouts, 8 KiB of headers, 4 KiB of body, 5 requests. The registry must outlive
// the server; the destructor stops listening and waits for the requests in progress.
class MetricsHttpServer {
 public:
  // Listens on `host` (an IPv4 or IPv6 address, bracketed or not, "::" for both families; or a
  // name) and `port` (0: a free one, see port()). With `tls_setup` it speaks HTTPS only (TLS 1.2
  // or newer) on a context `tls_setup` gives its identity (service/tls's RotatingCertificate);
  // it is called once, in Start. INVALID_ARGUMENT: a null registry, a port out of range, a host
  // that does not resolve, a `tls_setup` that fails; UNAVAILABLE: the port cannot be bound
  // ("... Address already in use").
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, Registry* registry,
      std::function<bool(SSL_CTX&)> tls_setup = nullptr);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer();

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace attnd::metrics
