#include "metrics/metrics_https.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/accept_loop.h"

namespace attnd::metrics {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
constexpr int kIoTimeoutS = 5;

int64_t SteadySeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Both files' modification times in one number (0 when either cannot be read).
int64_t Stamp(const MetricsTlsFiles& f) {
  struct stat a {
  }, b{};
  if (stat(f.cert.c_str(), &a) != 0 || stat(f.key.c_str(), &b) != 0) return 0;
  return (int64_t{a.st_mtim.tv_sec} * 1000000000 + a.st_mtim.tv_nsec) ^
         ((int64_t{b.st_mtim.tv_sec} * 1000000000 + b.st_mtim.tv_nsec) << 1) ^ a.st_ino ^
         (b.st_ino << 7);
}

SSL_CTX* NewContext(const MetricsTlsFiles& f) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return nullptr;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, f.cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx, f.key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    SSL_CTX_free(ctx);
    ERR_clear_error();
    return nullptr;
  }
  return ctx;
}

std::string Response(int code, const char* reason, const std::string& type, const std::string& body,
                     bool head) {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                      head ? "" : body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> MetricsHttpsServer::Start(
    const std::string& listen, Registry* registry, MetricsTlsFiles files) {
  if (registry == nullptr) return absl::InvalidArgumentError("MetricsHttpsServer: null registry");
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? "0.0.0.0" : listen.substr(0, colon);
  int port = -1;
  if (!absl::SimpleAtoi(colon == std::string::npos ? listen : listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535 || host.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address \"", listen, "\": expected HOST:PORT or PORT"));
  std::unique_ptr<MetricsHttpsServer> s(new MetricsHttpsServer(registry, std::move(files)));
  s->ctx_ = NewContext(s->files_);
  if (s->ctx_ == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("metrics tls: cannot load ", s->files_.cert,
                                                   " and ", s->files_.key, " (or they differ)"));
  s->stamp_ = Stamp(s->files_);
  s->checked_at_ = SteadySeconds();
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen address: cannot resolve ", host));
  sockaddr_in addr{};
  std::memcpy(&addr, res->ai_addr, sizeof(addr));
  freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  s->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t len = sizeof(addr);
  if (s->listen_fd_ < 0 || bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(s->listen_fd_, 16) != 0 ||
      getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    return absl::UnavailableError(
        absl::StrCat("metrics HTTPS server cannot listen on ", listen, ": ", std::strerror(errno)));
  s->port_ = ntohs(addr.sin_port);
  auto loop = AcceptLoop::Start(s->listen_fd_, [p = s.get()](int fd) {
    p->Serve(fd);  // one connection at a time
    close(fd);
  });
  if (!loop.ok()) return loop.status();
  s->loop_ = std::move(loop).value();
  return s;
}

MetricsHttpsServer::MetricsHttpsServer(Registry* registry, MetricsTlsFiles files)
    : registry_(registry), files_(std::move(files)) {}

MetricsHttpsServer::~MetricsHttpsServer() {
  loop_.reset();  // waits for the connection in progress
  if (listen_fd_ >= 0) close(listen_fd_);
  if (ctx_ != nullptr) SSL_CTX_free(ctx_);
}

SSL_CTX* MetricsHttpsServer::Context() {
  const int64_t now = SteadySeconds();
  if (now - checked_at_ >= files_.reload_interval_s) {
    checked_at_ = now;
    const int64_t stamp = Stamp(files_);
    if (stamp != 0 && stamp != stamp_) {
      if (SSL_CTX* fresh = NewContext(files_)) {  // a half-written pair keeps the old context
        SSL_CTX_free(ctx_);
        ctx_ = fresh;
        stamp_ = stamp;
      }
    }
  }
  return ctx_;
}

void MetricsHttpsServer::Serve(int fd) {
  timeval tv{kIoTimeoutS, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  SSL* ssl = SSL_new(Context());
  if (ssl == nullptr) return;
  SSL_set_fd(ssl, fd);
  if (SSL_accept(ssl) == 1) {
    std::string req;
    char buf[1024];
    while (req.find("\r\n\r\n") == std::string::npos && req.size() < kMaxRequestBytes) {
      const int n = SSL_read(ssl, buf, sizeof(buf));
      if (n <= 0) break;
      req.append(buf, static_cast<size_t>(n));
    }
    const size_t eol = req.find("\r\n");
    const std::string line = req.substr(0, eol == std::string::npos ? 0 : eol);
    const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
    const std::string method = line.substr(0, sp1);
    std::string path = sp1 == std::string::npos
                           ? ""
                           : line.substr(sp1 + 1, sp2 == std::string::npos ? 0 : sp2 - sp1 - 1);
    path = path.substr(0, path.find('?'));
    std::string out;
    if (path != "/metrics") {
      out = Response(404, "Not Found", "text/plain", "not found\n", method == "HEAD");
    } else if (method != "GET" && method != "HEAD") {
      out = Response(405, "Method Not Allowed", "text/plain", "GET or HEAD\n", false);
    } else {
      out = Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", registry_->Serialize(),
                     method == "HEAD");
    }
    size_t sent = 0;
    while (sent < out.size()) {
      const int n = SSL_write(ssl, out.data() + sent, static_cast<int>(out.size() - sent));
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    SSL_shutdown(ssl);
  }
  SSL_free(ssl);
  ERR_clear_error();
}

}  // namespace attnd::metrics
