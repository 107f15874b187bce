#include "tests/test_pki.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

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

}  // namespace attnd::testing
