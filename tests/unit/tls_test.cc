// service/tls (built into auth_test, the trust tests' binary): the files the flags name checked
// at start, and the metrics port's rotating certificate, served through a real MetricsHttpServer
// and rotated under it.
#include "service/tls.h"

#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "metrics/metrics_http.h"
#include "tests/test_pki.h"

namespace attnd {
namespace {

TEST(TlsFilesTest, StartRefusesFilesThatCannotServeNamingTheFlag) {
  testing::TestPki pki;
  pki.MakeCa("ca");
  pki.MakeLeaf("a", "ca", "a", "IP:127.0.0.1");
  pki.MakeLeaf("b", "ca", "b", "IP:127.0.0.1");
  const struct {
    TlsFiles files;
    const char* want;
  } cases[] = {
      {{pki.Cert("a"), pki.Key("b"), "", 10}, "does not belong"},
      {{pki.dir() + "/missing.pem", pki.Key("a"), "", 10}, "--tls-cert: cannot read"},
      {{pki.Cert("a"), pki.Cert("a"), "", 10}, "--tls-key: no PEM private key"},
      {{pki.Cert("a"), pki.Key("a"), pki.Key("a"), 10}, "--tls-client-ca"},
  };
  for (const auto& c : cases) {
    const absl::Status s = CheckTlsFiles(c.files);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.want), std::string::npos) << s;
    if (c.files.client_ca.empty()) {
      EXPECT_EQ(RotatingCertificate::Load(c.files).status(), s);
    }
  }
  EXPECT_TRUE(CheckTlsFiles({pki.Cert("a"), pki.Key("a"), pki.Cert("ca"), 10}).ok());
  EXPECT_EQ(RotatingCertificate::Load({"", "", "", 10}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RotatingCertificateTest, TheMetricsPortPicksUpARotationAndKeepsItsPairOverABrokenOne) {
  testing::TestPki pki;
  pki.MakeCa("ca");
  pki.MakeLeaf("old", "ca", "metrics-old", "IP:127.0.0.1");
  pki.MakeLeaf("new", "ca", "metrics-new", "IP:127.0.0.1");
  const std::string cert = pki.dir() + "/serving.pem", key = pki.dir() + "/serving.key";
  testing::ReplaceFile(pki.Cert("old"), cert);
  testing::ReplaceFile(pki.Key("old"), key);
  absl::StatusOr<std::unique_ptr<RotatingCertificate>> identity =
      RotatingCertificate::Load({cert, key, "", /*reload_interval_s=*/1});
  ASSERT_TRUE(identity.ok()) << identity.status();
  metrics::Registry registry;
  registry.AddGauge("attnd_test_up", "Up.").Add({}).Set(1);
  absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> server =
      metrics::MetricsHttpServer::Start(
          "127.0.0.1", 0, &registry,
          [c = identity->get()](SSL_CTX& ctx) { return c->InstallOn(ctx); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  testing::TlsResponse got = testing::TlsGet(port, pki.Cert("ca"), "/metrics");
  EXPECT_NE(got.subject.find("CN=metrics-old"), std::string::npos) << got.subject;
  EXPECT_EQ(got.status, 200);
  EXPECT_NE(got.body.find("attnd_test_up 1"), std::string::npos) << got.body;

  // Half a rotation (a key that is not the certificate's) keeps the pair served before.
  testing::ReplaceFile(pki.Key("new"), key);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  got = testing::TlsGet(port, pki.Cert("ca"), "/metrics");
  EXPECT_NE(got.subject.find("CN=metrics-old"), std::string::npos) << got.subject;
  EXPECT_EQ(got.status, 200);
  // The whole new pair is served once the interval has passed, without a restart.
  testing::ReplaceFile(pki.Cert("new"), cert);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (got.subject.find("CN=metrics-new") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    got = testing::TlsGet(port, pki.Cert("ca"), "/metrics");
  }
  EXPECT_NE(got.subject.find("CN=metrics-new"), std::string::npos) << got.subject;
  EXPECT_EQ(got.status, 200);
}

}  // namespace
}  // namespace attnd
