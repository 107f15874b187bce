#include "service/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

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

absl::StatusOr<std::unique_ptr<RotatingCertificate>> RotatingCertificate::Load(
    const TlsFiles& files) {
  TlsFiles own{files.cert, files.key, "", files.reload_interval_s};
  if (own.cert.empty()) return absl::InvalidArgumentError("--metrics-tls needs --tls-cert");
  if (absl::Status s = CheckTlsFiles(own); !s.ok()) return s;
  std::unique_ptr<RotatingCertificate> c(new RotatingCertificate(std::move(own)));
  if (absl::Status s = c->Reload(); !s.ok()) return s;
  return c;
}

RotatingCertificate::~RotatingCertificate() { SSL_CTX_free(pair_); }

bool RotatingCertificate::InstallOn(SSL_CTX& ctx) {
  SSL_CTX_set_cert_cb(&ctx, &RotatingCertificate::Present, this);
  return true;
}

std::string RotatingCertificate::Stamp() const {
  struct stat c {
  }, k{};
  if (stat(files_.cert.c_str(), &c) != 0 || stat(files_.key.c_str(), &k) != 0) return "";
  return absl::StrCat(c.st_mtim.tv_sec, ".", c.st_mtim.tv_nsec, "/", c.st_ino, ":",
                      k.st_mtim.tv_sec, ".", k.st_mtim.tv_nsec, "/", k.st_ino);
}

absl::Status RotatingCertificate::Reload() {
  checked_at_ = std::chrono::steady_clock::now();
  stamp_ = Stamp();
  SSL_CTX* pair = SSL_CTX_new(TLS_server_method());
  if (pair == nullptr || SSL_CTX_use_certificate_chain_file(pair, files_.cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(pair, files_.key.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(pair) != 1) {
    SSL_CTX_free(pair);
    char reason[256] = "unknown error";
    if (const unsigned long e = ERR_get_error(); e != 0)
      ERR_error_string_n(e, reason, sizeof(reason));
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert/--tls-key: cannot use ", files_.cert,
                                                   " and ", files_.key, ": ", reason));
  }
  SSL_CTX_free(pair_);
  pair_ = pair;
  return absl::OkStatus();
}

int RotatingCertificate::Present(SSL* ssl, void* self) {
  auto* c = static_cast<RotatingCertificate*>(self);
  std::lock_guard<std::mutex> lock(c->mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - c->checked_at_ >= std::chrono::seconds(c->files_.reload_interval_s)) {
    c->checked_at_ = now;
    if (c->Stamp() != c->stamp_)
      if (absl::Status s = c->Reload(); !s.ok())
        LOG(WARNING) << s.message() << "; the metrics port keeps the pair it had";
  }
  STACK_OF(X509)* chain = nullptr;
  SSL_CTX_get0_chain_certs(c->pair_, &chain);
  return SSL_use_cert_and_key(ssl, SSL_CTX_get0_certificate(c->pair_),
                              SSL_CTX_get0_privatekey(c->pair_), chain, 1);
}

}  // namespace attnd
