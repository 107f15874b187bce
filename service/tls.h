// Transport security from the flags (docs/trust.md): TLS with the certificate files watched for
// rotation, optionally requiring verified client certificates (mTLS).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

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

}  // namespace attnd
