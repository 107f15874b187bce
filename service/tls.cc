#include "service/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdio>
#include <memory>

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

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
using Certificate = std::unique_ptr<X509, X509Free>;

// The first PEM certificate of the file `flag` names.
absl::StatusOr<Certificate> ReadCertificate(const char* flag, const std::string& path) {
  absl::StatusOr<File> f = Open(flag, path);
  if (!f.ok()) return f.status();
  Certificate cert(PEM_read_X509(f->get(), nullptr, nullptr, nullptr));
  if (cert == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(flag, ": no PEM certificate in ", path));
  return cert;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files) {
  if (files.cert.empty()) return absl::OkStatus();
  absl::StatusOr<Certificate> cert = ReadCertificate("--tls-cert", files.cert);
  if (!cert.ok()) return cert.status();
  auto key_file = Open("--tls-key", files.key);
  if (!key_file.ok()) return key_file.status();
  EVP_PKEY* key = PEM_read_PrivateKey(key_file->get(), nullptr, nullptr, nullptr);
  const bool have_key = key != nullptr;
  const bool match = have_key && X509_check_private_key(cert->get(), key) == 1;
  EVP_PKEY_free(key);
  if (!have_key)
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: no PEM private key in ", files.key));
  if (!match) return absl::InvalidArgumentError("--tls-key: the key does not belong to --tls-cert");
  if (!files.client_ca.empty())
    if (absl::Status s = ReadCertificate("--tls-client-ca", files.client_ca).status(); !s.ok())
      return s;
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
