// The token file (service/auth.h): its format, its errors (which never quote a token), the
// per-tenant quota overrides merged over the flags, and tenant names.
#include "service/auth.h"

#include <gtest/gtest.h>

#include <fstream>

namespace attnd {
namespace {

constexpr char kA[] = "tok-aaaaaaaaaaaaaaaa";
constexpr char kB[] = "tok-bbbbbbbbbbbbbbbb";

TEST(TokenFile, ParsesTokensTenantsAndQuotaOverrides) {
  auto t =
      ParseTokenFile(absl::StrCat("# a comment\n\n", kA, "  team-a pages=10 steps=2  # x\n", kB,
                                  "\tteam-a sequences=3\r\n", "tok-cccccccccccccccc ops\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->entries.size(), 3u);
  EXPECT_EQ(t->entries[0].tenant, "team-a");
  EXPECT_EQ(t->entries[2].tenant, "ops");
  EXPECT_NE(t->entries[0].digest, t->entries[1].digest);
  const auto& q = t->quotas.at("team-a");
  EXPECT_EQ(q.pages, 10);
  EXPECT_EQ(q.steps, 2);
  EXPECT_EQ(q.sequences, 3);
  EXPECT_FALSE(q.shm_regions.has_value());
}

TEST(TokenFile, BadLinesNameTheLineAndNeverQuoteAToken) {
  const std::string secret = "tok-secret-secret-secret";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {secret + "\n", "line 1: want TOKEN TENANT"},
      {"short tenant\n", "line 1: token shorter than 16"},
      {"\n" + secret + " a\n" + secret + " b\n", "line 3: token repeated"},
      {secret + " a pages=-1\n", "line 1: 'pages' needs a non-negative integer"},
      {secret + " a pages=x\n", "needs a non-negative integer"},
      {secret + " a bogus=1\n", "unknown quota 'bogus'"},
      {std::string(kA) + " a pages=1\n" + kB + " a pages=2\n", "line 2: tenant a: pages="},
      {secret + " caf\xc3\xa9\n", "tenant names are"},
  };
  for (const auto& [text, want] : cases) {
    auto t = ParseTokenFile(text);
    ASSERT_FALSE(t.ok()) << text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(want), std::string::npos) << t.status();
    EXPECT_EQ(t.status().message().find("secret"), std::string::npos) << t.status();
  }
}

TEST(TokenFile, OverridesKeepTheFlagsForFieldsTheFileLeavesOut) {
  const std::string path = ::testing::TempDir() + "/tokens.txt";
  {
    FILE* f = std::fopen(path.c_str(), "w");
    std::fprintf(f, "%s a pages=7\n%s b\n", kA, kB);
    std::fclose(f);
  }
  auto auth = Authenticator::Create({AuthMode::kToken, path, "", ""});
  ASSERT_TRUE(auth.ok()) << auth.status();
  const TenantQuota flags{100, 5, 2, 1};
  const auto o = (*auth)->QuotaOverrides(flags);
  EXPECT_EQ(o.at("a").pages, 7);
  EXPECT_EQ(o.at("a").sequences, 5);
  EXPECT_EQ(o.at("a").open_steps, 2);
  EXPECT_EQ(o.at("b").pages, 100);
  EXPECT_FALSE((*auth)->ReloadIfChanged().value()) << "unchanged file: nothing reloaded";
  std::remove(path.c_str());
  EXPECT_EQ((*auth)->ReloadIfChanged().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*auth)->QuotaOverrides(flags).at("a").pages, 7) << "the old table stays";
}

TEST(Authenticator, RefusesInconsistentOptions) {
  EXPECT_FALSE(Authenticator::Create({AuthMode::kToken, "", "", ""}).ok());
  EXPECT_FALSE(Authenticator::Create({AuthMode::kNone, "", "ops", ""}).ok());
  EXPECT_FALSE(Authenticator::Create({AuthMode::kMtls, "", "bad name", ""}).ok());
  EXPECT_FALSE(Authenticator::Create({AuthMode::kToken, "/no/such/file", "", ""}).ok());
  EXPECT_TRUE(Authenticator::Create({AuthMode::kMtls, "", "ops", ""}).ok());
  // --admin-token-file: for --auth=none only, and a readable token of at least 16 characters.
  const std::string admin = ::testing::TempDir() + "/admin-token";
  std::ofstream(admin) << "short\n";
  EXPECT_FALSE(Authenticator::Create({AuthMode::kNone, "", "", admin}).ok());
  std::ofstream(admin) << "a-token-long-enough-for-it\n";
  EXPECT_TRUE(Authenticator::Create({AuthMode::kNone, "", "", admin}).ok());
  EXPECT_FALSE(Authenticator::Create({AuthMode::kMtls, "", "ops", admin}).ok());
  EXPECT_FALSE(Authenticator::Create({AuthMode::kNone, "", "", "/no/such/file"}).ok());
}

// Without --auth the admin calls are served to loopback peers only: what counts as loopback.
TEST(LoopbackPeer, OnlyThisHostsTcpAddresses) {
  for (const char* peer :
       {"ipv4:127.0.0.1:5000", "ipv4:127.9.8.7:1", "ipv6:[::1]:5000", "ipv6:[::ffff:127.0.0.1]:80"})
    EXPECT_TRUE(IsLoopbackPeer(peer)) << peer;
  for (const char* peer : {"ipv4:10.0.0.1:5000", "ipv4:128.0.0.1:1", "ipv6:[2001:db8::1]:5000",
                           "ipv6:[::ffff:10.0.0.1]:1", "ipv6:[::2]:1", "fd:7", "unix:/tmp/s", "",
                           "ipv4:", "ipv6:[::1", "127.0.0.1:5000"})
    EXPECT_FALSE(IsLoopbackPeer(peer)) << peer;
}

TEST(TenantName, PrintableAsciiWithoutSpaces) {
  for (const char* ok : {"a", "team-a", "spiffe://cluster/ns/x/sa/y", "user@example.com"})
    EXPECT_TRUE(CheckTenantName(ok).ok()) << ok;
  for (const std::string& bad : {std::string(), std::string("a b"), std::string("a\tb"),
                                 std::string(257, 'x'), std::string("nul\0x", 5)})
    EXPECT_FALSE(CheckTenantName(bad).ok()) << bad;
}

}  // namespace
}  // namespace attnd
