#include "metrics/metrics_http.h"

#include <netdb.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "httplib.h"

namespace attnd::metrics {

MetricsHttpServer::MetricsHttpServer() = default;

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host_in, int port, Registry* registry,
    std::function<bool(SSL_CTX&)> tls_setup) {
  if (registry == nullptr) return absl::InvalidArgumentError("MetricsHttpServer: null registry");
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, ": not in 0..65535"));
  std::string host(absl::StripSuffix(absl::StripPrefix(host_in, "["), "]"));
  addrinfo hints{0, 0, SOCK_STREAM, 0, 0, nullptr, nullptr, nullptr}, *found = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", host_in, "\": not an address or a name that resolves"));
  freeaddrinfo(found);

  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  if (tls_setup) {
    s->server_ = std::make_unique<httplib::SSLServer>([&tls_setup](SSL_CTX& ctx) {
      SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
      return tls_setup(ctx);
    });
  } else {
    s->server_ = std::make_unique<httplib::Server>();
  }
  httplib::Server& server = *s->server_;
  if (!server.is_valid()) return absl::InvalidArgumentError("metrics server: TLS set-up failed");
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  server.set_read_timeout(5).set_write_timeout(5).set_payload_max_length(4096);
  server.set_keep_alive_max_count(5);
  // SO_REUSEADDR only: with httplib's SO_REUSEPORT a second server would share the port.
  server.set_socket_options([](int fd) {
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  });
  server.Get("/metrics", [registry](const httplib::Request&, httplib::Response& response) {
    response.set_content(registry->Serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });
  const auto refuse = [](const httplib::Request&, httplib::Response& response) {
    response.status = 405;
    response.set_header("Allow", "GET, HEAD");
  };
  server.Post("/metrics", refuse).Put("/metrics", refuse).Patch("/metrics", refuse);
  server.Delete("/metrics", refuse).Options("/metrics", refuse);

  errno = 0;
  const bool bound = port == 0 ? (s->port_ = server.bind_to_any_port(host)) > 0
                               : server.bind_to_port(host, s->port_ = port);
  if (!bound)
    return absl::UnavailableError(
        absl::StrCat("metrics server cannot listen on ",
                     host.find(':') == std::string::npos ? host : absl::StrCat("[", host, "]"), ":",
                     port, ": ", errno != 0 ? std::strerror(errno) : "bind failed"));
  s->thread_ = std::thread([&server] { server.listen_after_bind(); });
  // Until it runs: stop() before then would be lost, and the destructor's join would wait forever.
  for (int i = 0; i < 5000 && !server.is_running(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!server.is_running()) return absl::UnavailableError("metrics server did not start");
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    server_->stop();
    thread_.join();
  }
}

}  // namespace attnd::metrics
