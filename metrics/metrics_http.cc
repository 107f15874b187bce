#include "metrics/metrics_http.h"

#include <civetweb.h>
#include <netdb.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnd::metrics {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kMetricsPath[] = "/metrics";

// mg_start initialises the library lazily but not thread-safely; do it once, before any start.
// TLS is initialised too (civetweb loads OpenSSL), for servers started with a certificate.
void InitCivetwebOnce() {
  static const unsigned features = mg_init_library(MG_FEATURES_TLS);
  (void)features;
}

// civetweb's init_ssl callback: the certificate chain and key from their own files (civetweb's
// ssl_certificate option wants both in one file). 1 = set up here; -1 = failed.
int InitSsl(void* ssl_ctx, void* user_data) {
  const auto* tls =
      static_cast<const MetricsTls*>(static_cast<const MetricsHttpServer*>(user_data)->tls());
  SSL_CTX* ctx = static_cast<SSL_CTX*>(ssl_ctx);
  if (SSL_CTX_use_certificate_chain_file(ctx, tls->cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx, tls->key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1)
    return -1;
  return 1;
}

// Catches what civetweb would misread rather than reject: a list of ports, TLS or redirect
// suffixes ("9090s"), out-of-range numbers. The host itself is left to civetweb.
absl::Status ValidateListen(absl::string_view listen) {
  const auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\": ", why,
                     " (expected HOST:PORT or PORT, e.g. 0.0.0.0:9090 or 127.0.0.1:0)"));
  };
  if (listen.find('[') != absl::string_view::npos) {
    return invalid("IPv6 is not supported by this civetweb build");
  }
  const size_t colon = listen.rfind(':');
  const absl::string_view host =
      colon == absl::string_view::npos ? absl::string_view() : listen.substr(0, colon);
  const absl::string_view port =
      colon == absl::string_view::npos ? listen : listen.substr(colon + 1);
  if (colon != absl::string_view::npos && host.empty()) return invalid("empty host");
  for (char c : host) {
    if (c == ',' || c == ':' || absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return invalid("bad host");
    }
  }
  int port_number = -1;
  const bool all_digits =
      !port.empty() && port.find_first_not_of("0123456789") == absl::string_view::npos;
  if (!all_digits || !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return invalid("PORT must be a number in [0, 65535]");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, Registry* registry, std::optional<MetricsTls> tls) {
  if (registry == nullptr) return absl::InvalidArgumentError("MetricsHttpServer: null registry");
  if (absl::Status status = ValidateListen(listen); !status.ok()) return status;
  InitCivetwebOnce();

  auto server = absl::WrapUnique(new MetricsHttpServer(registry));
  server->tls_ = std::move(tls);
  const std::string listen_ports = server->tls_ ? listen + "s" : listen;  // "s": speaks TLS
  const char* options[] = {
      "listening_ports",
      listen_ports.c_str(),
      // TLS 1.2 or newer.
      "ssl_protocol_version",
      "4",
      // Scrapes are rare and cheap; two workers keep one slow client from blocking the next.
      "num_threads",
      "2",
      // A stalled client must not hold a worker forever.
      "request_timeout_ms",
      "10000",
      nullptr,
  };
  mg_callbacks callbacks = {};
  callbacks.log_message = &MetricsHttpServer::LogMessage;
  if (server->tls_) callbacks.init_ssl = &InitSsl;
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error = {};
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);

  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(server->log_mu_);
      // The log holds the cause (e.g. the bind error); error_text only the stage that failed.
      reason = server->start_log_.empty() ? std::string(error_text) : server->start_log_;
    }
    return absl::UnavailableError(
        absl::StrCat("metrics HTTP server cannot listen on ", listen, ": ", reason));
  }
  // From here on ~MetricsHttpServer stops the context, also on the error paths below.
  mg_set_request_handler(server->context_, "/", &MetricsHttpServer::HandleRequest, server.get());

  mg_server_port ports[2] = {};
  if (mg_get_server_ports(server->context_, 2, ports) < 1 || ports[0].port <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics HTTP server on ", listen, ": civetweb reports no listening port"));
  }
  server->port_ = ports[0].port;
  // Where ~MetricsHttpServer knocks: the bound host, or loopback for all interfaces.
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  server->wake_host_ = host.empty() || host == "0.0.0.0" ? "127.0.0.1" : host;
  {
    std::lock_guard<std::mutex> lock(server->log_mu_);
    server->started_ = true;
  }
  return server;
}

namespace {
// One TCP connection to host:port, closed at once (nothing sent).
void Knock(const std::string& host, int port) {
  addrinfo hints = {};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    (void)connect(fd, found->ai_addr, found->ai_addrlen);
    close(fd);
  }
  freeaddrinfo(found);
}
}  // namespace

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ == nullptr) return;
  // civetweb's listener notices the stop only between 2-s poll rounds, and mg_stop waits for it
  // (every attnd took 2 s to exit). A connection wakes the poll: knock on our own port while
  // mg_stop runs, after it has had time to raise its stop flag (so no worker takes the knock;
  // one that did would read EOF at once).
  std::mutex mu;
  std::condition_variable cv;
  bool stopped = false;
  std::thread waker([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopped; })) {
      lock.unlock();
      Knock(wake_host_, port_);
      lock.lock();
    }
  });
  mg_stop(context_);
  {
    std::lock_guard<std::mutex> lock(mu);
    stopped = true;
  }
  cv.notify_all();
  waker.join();
}

int MetricsHttpServer::HandleRequest(mg_connection* connection, void* server) {
  const mg_request_info* request = mg_get_request_info(connection);
  const absl::string_view path = request->local_uri != nullptr ? request->local_uri : "";
  const absl::string_view method =
      request->request_method != nullptr ? request->request_method : "";
  if (path != kMetricsPath) {
    mg_send_http_error(connection, 404, "Not found; metrics are at %s\n", kMetricsPath);
    return 404;
  }
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    static constexpr char kBody[] = "Method not allowed; use GET\n";
    mg_response_header_start(connection, 405);
    mg_response_header_add(connection, "Allow", "GET, HEAD", -1);
    mg_response_header_add(connection, "Content-Type", "text/plain; charset=utf-8", -1);
    const std::string length = absl::StrCat(sizeof(kBody) - 1);
    mg_response_header_add(connection, "Content-Length", length.c_str(), -1);
    mg_response_header_send(connection);
    mg_write(connection, kBody, sizeof(kBody) - 1);
    return 405;
  }
  const std::string body = static_cast<MetricsHttpServer*>(server)->registry_->Serialize();
  mg_send_http_ok(connection, kContentType, static_cast<long long>(body.size()));
  if (!head) mg_write(connection, body.data(), body.size());
  return 200;
}

int MetricsHttpServer::LogMessage(const mg_connection* connection, const char* message) {
  auto* server = static_cast<MetricsHttpServer*>(mg_get_user_data(mg_get_context(connection)));
  if (server != nullptr) {
    std::lock_guard<std::mutex> lock(server->log_mu_);
    if (!server->started_) {
      if (!server->start_log_.empty()) server->start_log_ += "; ";
      server->start_log_ += message;
      return 1;
    }
  }
  std::fprintf(stderr, "attnd metrics http: %s\n", message);
  return 1;  // handled: civetweb logs nothing itself
}

}  // namespace attnd::metrics
