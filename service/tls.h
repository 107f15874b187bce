// Transport security from the flags (docs/trust.md): TLS with the certificate files watched for
// rotation, optionally requiring verified client certificates (mTLS).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace attnd {

struct TlsFiles {
  std::string cert;       // PEM certificate chain; empty = no TLS
  std::string key;        // PEM private key
  std::string client_ca;  // PEM CA bundle; set = require and verify client certificates
  int reload_interval_s = 10;
};

// INVALID_ARGUMENT naming the file unless the chain and key parse and belong together and the
// CA bundle holds at least one certificate. Run at startup: later rotations are checked by gRPC,
// which keeps serving the last good pair when a rotated file is broken.
absl::Status CheckTlsFiles(const TlsFiles& files);

// Insecure credentials without a certificate; otherwise TLS whose files gRPC rereads every
// reload_interval_s (new connections get the new certificate; open ones keep theirs).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);

// The metrics port's HTTPS identity (--metrics-tls): the certificate and key files, reread when
// they change (looked at most every reload_interval_s, as gRPC looks at its own), so a rotation
// needs no restart; a broken rewrite keeps the last good pair, with a warning.
class RotatingCertificate {
 public:
  // CheckTlsFiles's errors (client_ca is not used here).
  static absl::StatusOr<std::unique_ptr<RotatingCertificate>> Load(const TlsFiles& files);
  ~RotatingCertificate();

  // Makes every handshake on `ctx` present the current pair. This object must outlive `ctx`.
  bool InstallOn(SSL_CTX& ctx);

 private:
  explicit RotatingCertificate(TlsFiles files) : files_(std::move(files)) {}
  absl::Status Reload();  // under mu_ (or before anyone else has the object)
  std::string Stamp() const;
  static int Present(SSL* ssl, void* self);  // OpenSSL's certificate callback

  const TlsFiles files_;
  std::mutex mu_;  // guards the three below
  SSL_CTX* pair_ = nullptr;
  std::string stamp_;  // Stamp() at the last Reload
  std::chrono::steady_clock::time_point checked_at_;
};

}  // namespace attnd
