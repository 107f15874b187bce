#include "tests/test_pki.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

namespace attnd::testing {
namespace {

void Run(const std::string& cmd) {
  const int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  if (rc != 0) {
    std::fprintf(stderr, "test pki: '%s' failed (%d)\n", cmd.c_str(), rc);
    std::abort();
  }
}

constexpr char kEc[] = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

}  // namespace

TestPki::TestPki() {
  std::string tmpl = std::filesystem::temp_directory_path().string() + "/attnd-pki-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) std::abort();
  dir_ = tmpl;
}

TestPki::~TestPki() { std::filesystem::remove_all(dir_); }

void TestPki::MakeCa(const std::string& name) {
  Run("openssl req -x509 " + std::string(kEc) + " -days 2 -subj /CN=" + name + "-ca -keyout " +
      Key(name) + " -out " + Cert(name) +
      " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign");
}

void TestPki::MakeLeaf(const std::string& name, const std::string& ca, const std::string& cn,
                       const std::string& san) {
  const std::string ext = dir_ + "/" + name + ".ext", csr = dir_ + "/" + name + ".csr";
  {
    std::ofstream f(ext);
    f << "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
         "extendedKeyUsage=serverAuth,clientAuth\n";
    if (!san.empty()) f << "subjectAltName=" << san << "\n";
  }
  Run("openssl req -new " + std::string(kEc) + " -subj /CN=" + cn + " -keyout " + Key(name) +
      " -out " + csr);
  Run("openssl x509 -req -in " + csr + " -CA " + Cert(ca) + " -CAkey " + Key(ca) +
      " -CAcreateserial -days 2 -extfile " + ext + " -out " + Cert(name));
}

void ReplaceFile(const std::string& src, const std::string& dst) {
  const std::string tmp = dst + ".new";
  std::filesystem::copy_file(src, tmp, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::rename(tmp, dst);
}

int ConnectLoopback(int port, bool ipv6) {
  const int fd = socket(ipv6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    ADD_FAILURE() << "socket: " << std::strerror(errno);
    return -1;
  }
  timeval timeout = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sockaddr_in6 address6 = {};
  address6.sin6_family = AF_INET6;
  address6.sin6_port = htons(static_cast<uint16_t>(port));
  address6.sin6_addr = in6addr_loopback;
  const int connected = ipv6 ? connect(fd, reinterpret_cast<sockaddr*>(&address6), sizeof(address6))
                             : connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  if (connected != 0) {
    ADD_FAILURE() << "connect to port " << port << ": " << std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

TlsResponse TlsGet(int port, const std::string& ca, const std::string& path, int max_version) {
  TlsResponse out;
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        SSL_CTX_free);
  SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  if (max_version != 0) {
    SSL_CTX_set_security_level(ctx.get(), 0);  // so that the client offers old versions at all
    SSL_CTX_set_min_proto_version(ctx.get(), 0);
    SSL_CTX_set_max_proto_version(ctx.get(), max_version);
  }
  const int fd = ConnectLoopback(port);
  if (fd < 0) return out;
  SSL* ssl = SSL_new(ctx.get());
  SSL_set_fd(ssl, fd);
  if (SSL_connect(ssl) == 1) {
    out.handshake = true;
    if (X509* peer = SSL_get1_peer_certificate(ssl)) {
      char line[256];
      X509_NAME_oneline(X509_get_subject_name(peer), line, sizeof(line));
      out.subject = line;
      X509_free(peer);
    }
    const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    SSL_write(ssl, request.data(), static_cast<int>(request.size()));
    std::string raw;
    char buffer[4096];
    int n;
    while ((n = SSL_read(ssl, buffer, sizeof(buffer))) > 0) raw.append(buffer, n);
    if (raw.rfind("HTTP/1.1 ", 0) == 0) out.status = std::atoi(raw.substr(9, 3).c_str());
    const size_t body = raw.find("\r\n\r\n");
    if (body != std::string::npos) out.body = raw.substr(body + 4);
  }
  SSL_free(ssl);
  close(fd);
  return out;
}

}  // namespace attnd::testing
