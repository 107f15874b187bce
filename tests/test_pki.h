// Certificates for integration tests, made by the openssl command line in a scratch directory:
// certificate authorities and leaf certificates (server and client) signed by them.
#pragma once

#include <string>

namespace attnd::testing {

class TestPki {
 public:
  // A fresh directory under $TMPDIR (removed by the destructor).
  TestPki();
  ~TestPki();
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  // A self-signed CA named `name`.
  void MakeCa(const std::string& name);
  // A leaf `name` signed by CA `ca`, subject CN=`cn`, with subjectAltName `san` ("DNS:x,IP:y";
  // empty: none), usable for server and client authentication.
  void MakeLeaf(const std::string& name, const std::string& ca, const std::string& cn,
                const std::string& san);
  std::string Cert(const std::string& name) const { return dir_ + "/" + name + ".pem"; }
  std::string Key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// Replaces `dst` by a copy of `src` atomically (a rename), as a secret rotation does.
void ReplaceFile(const std::string& src, const std::string& dst);

// A TCP connection to 127.0.0.1 (or ::1) on `port` with a 10-s receive timeout; -1 and a test
// failure when it cannot be made.
int ConnectLoopback(int port, bool ipv6 = false);

struct TlsResponse {
  bool handshake = false;
  std::string subject;  // the server certificate's subject, one line
  int status = -1;      // the HTTP status
  std::string body;
};

// GET `path` over HTTPS on 127.0.0.1:`port`, verifying the server against the CA file `ca`;
// `max_version` (e.g. TLS1_1_VERSION) caps the protocol the client offers (0: no cap).
TlsResponse TlsGet(int port, const std::string& ca, const std::string& path, int max_version = 0);

}  // namespace attnd::testing
