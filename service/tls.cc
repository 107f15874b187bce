#include "service/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

absl::StatusOr<File> Open(const char* flag, const std::string& path) {
  File f(std::fopen(path.c_str(), "r"));
  if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  return f;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files) {
  if (files.cert.empty()) return absl::OkStatus();
  auto cert_file = Open("--tls-cert", files.cert);
  if (!cert_file.ok()) return cert_file.status();
  X509* cert = PEM_read_X509(cert_file->get(), nullptr, nullptr, nullptr);
  if (cert == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: no PEM certificate in ", files.cert));
  auto key_file = Open("--tls-key", files.key);
  if (!key_file.ok()) {
    X509_free(cert);
    return key_file.status();
  }
  EVP_PKEY* key = PEM_read_PrivateKey(key_file->get(), nullptr, nullptr, nullptr);
  const bool match = key != nullptr && X509_check_private_key(cert, key) == 1;
  EVP_PKEY_free(key);
  X509_free(cert);
  if (key == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: no PEM private key in ", files.key));
  if (!match) return absl::InvalidArgumentError("--tls-key: the key does not belong to --tls-cert");
  if (!files.client_ca.empty()) {
    auto ca_file = Open("--tls-client-ca", files.client_ca);
    if (!ca_file.ok()) return ca_file.status();
    X509* ca = PEM_read_X509(ca_file->get(), nullptr, nullptr, nullptr);
    if (ca == nullptr)
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-client-ca: no PEM certificate in ", files.client_ca));
    X509_free(ca);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  if (files.cert.empty()) return grpc::InsecureServerCredentials();
  if (absl::Status s = CheckTlsFiles(files); !s.ok()) return s;
  const auto interval = static_cast<unsigned>(files.reload_interval_s);
  auto provider = files.client_ca.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            files.key, files.cert, interval)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                            files.key, files.cert, files.client_ca, interval);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace attnd
