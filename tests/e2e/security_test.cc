// Trust (docs/trust.md) against a real attnd over loopback: TLS with certificates generated here,
// rotation picked up by a running server, mTLS identities, bearer tokens, tenant isolation for
// every RPC that names a sequence, step or region, quotas, the admin identity, random step ids,
// and the shared-memory policy (Unix socket only, owner check, name prefix).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"
#include "tests/server_process.h"
#include "tests/test_pki.h"

namespace attnd::testing {
namespace {

using client::Client;
using client::ConnectOptions;
using Code = absl::StatusCode;

std::unique_ptr<Client> Connect(const std::string& target, ConnectOptions o) {
  o.max_message_bytes = 64 << 20;
  auto c = Client::Connect(target, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(c).value();
}

ConnectOptions Tls(const TestPki& pki, const std::string& ca, const std::string& leaf = "") {
  ConnectOptions o;
  o.tls_ca_file = pki.Cert(ca);
  o.tls_server_name = "localhost";
  if (!leaf.empty()) {
    o.tls_cert_file = pki.Cert(leaf);
    o.tls_key_file = pki.Key(leaf);
  }
  return o;
}

// A short deadline: a refused handshake answers UNAVAILABLE, never hangs.
absl::Status InfoStatus(Client& c) { return c.Info().status(); }

// ---- TLS, rotation, mTLS -------------------------------------------------------------------

TEST(Tls, ServesTlsAndPicksUpRotatedCertificates) {
  TestPki pki;
  pki.MakeCa("ca1");
  pki.MakeCa("ca2");
  pki.MakeLeaf("server1", "ca1", "attnd", "DNS:localhost,IP:127.0.0.1");
  pki.MakeLeaf("server2", "ca2", "attnd", "DNS:localhost,IP:127.0.0.1");
  const std::string cert = pki.dir() + "/live.pem", key = pki.dir() + "/live.key";
  ReplaceFile(pki.Cert("server1"), cert);
  ReplaceFile(pki.Key("server1"), key);
  ServerProcess server(ATTND_BINARY,
                       {"--model=tiny", "--kv-pages=64", "--threads=1", "--metrics-port=0",
                        "--tls-cert=" + cert, "--tls-key=" + key, "--reload-interval-s=1"});
  auto ok = Connect(server.target(), Tls(pki, "ca1"));
  auto info = ok->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->auth(), "none");
  EXPECT_EQ(info->tenant(), "");
  EXPECT_FALSE(info->shm());
  // Shared memory is off on this server, whoever asks.
  EXPECT_EQ(ok->RegisterSharedMemory("r", "/attnd-x", 0, 16).code(), Code::kPermissionDenied);
  // Plaintext and a client trusting another CA are refused at the handshake.
  EXPECT_EQ(InfoStatus(*Client::Connect(server.target())).code(), Code::kUnavailable);
  EXPECT_EQ(InfoStatus(*Connect(server.target(), Tls(pki, "ca2"))).code(), Code::kUnavailable);

  // Rotation: the files are replaced under the running server; new connections get the new
  // certificate within a few reload intervals.
  ReplaceFile(pki.Key("server2"), key);
  ReplaceFile(pki.Cert("server2"), cert);
  absl::Status rotated = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !rotated.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rotated = InfoStatus(*Connect(server.target(), Tls(pki, "ca2")));
  }
  EXPECT_TRUE(rotated.ok()) << "the rotated certificate was not picked up in 10 s: " << rotated;
  EXPECT_EQ(InfoStatus(*Connect(server.target(), Tls(pki, "ca1"))).code(), Code::kUnavailable);
  ok.reset();
  EXPECT_EQ(server.Stop(), 0);
}

TEST(Mtls, TheClientCertificateNamesTheTenantAndNoCertificateIsRefused) {
  TestPki pki;
  pki.MakeCa("ca");
  pki.MakeCa("rogue");
  pki.MakeLeaf("server", "ca", "attnd", "DNS:localhost,IP:127.0.0.1");
  pki.MakeLeaf("team-a", "ca", "team-a", "");             // identity: the CN
  pki.MakeLeaf("team-b", "ca", "ignored", "DNS:team-b");  // identity: the first SAN
  pki.MakeLeaf("stranger", "rogue", "team-a", "");        // right name, wrong CA
  ServerProcess server(ATTND_BINARY,
                       {"--model=tiny", "--kv-pages=64", "--threads=1", "--metrics-port=0",
                        "--tls-cert=" + pki.Cert("server"), "--tls-key=" + pki.Key("server"),
                        "--tls-client-ca=" + pki.Cert("ca"), "--auth=mtls"});
  EXPECT_EQ(InfoStatus(*Connect(server.target(), Tls(pki, "ca"))).code(), Code::kUnavailable)
      << "a client without a certificate must be refused";
  EXPECT_EQ(InfoStatus(*Connect(server.target(), Tls(pki, "ca", "stranger"))).code(),
            Code::kUnavailable)
      << "a certificate from another CA must be refused";
  auto a = Connect(server.target(), Tls(pki, "ca", "team-a"));
  auto b = Connect(server.target(), Tls(pki, "ca", "team-b"));
  auto ia = a->Info(), ib = b->Info();
  ASSERT_TRUE(ia.ok() && ib.ok()) << ia.status() << ib.status();
  EXPECT_EQ(ia->tenant(), "team-a");
  EXPECT_EQ(ib->tenant(), "team-b");
  EXPECT_EQ(ia->auth(), "mtls");
  ASSERT_TRUE(a->OpenSequence("s").ok());
  EXPECT_EQ(b->DescribeSequence("s").status().code(), Code::kNotFound);
  EXPECT_TRUE(b->OpenSequence("s").ok()) << "b's namespace is its own";
  EXPECT_TRUE(a->CloseSequence("s").ok());
  EXPECT_TRUE(b->CloseSequence("s").ok());
  a.reset();
  b.reset();
  EXPECT_EQ(server.Stop(), 0);
}

// ---- tokens, isolation, quotas, admin, shared memory ----------------------------------------

constexpr char kTokenA[] = "token-a-0123456789abcdef";
constexpr char kTokenB[] = "token-b-0123456789abcdef";
constexpr char kTokenC[] = "token-c-0123456789abcdef";  // a tenant that holds nothing
constexpr char kTokenQ[] = "token-q-0123456789abcdef";  // a tenant with small quotas
constexpr char kTokenAdmin[] = "token-ops-0123456789abcd";
constexpr char kTokenLate[] = "token-late-0123456789abc";

class TokenTest : public ::testing::Test {
 protected:
  static std::string TokenFile() { return absl::StrCat("/tmp/attnd-tokens-", getpid(), ".txt"); }
  static void WriteTokens(bool with_late) {
    const std::string tmp = TokenFile() + ".new";
    {
      std::ofstream f(tmp);
      f << "# token tenant [quotas]\n"
        << kTokenA << " a\n"
        << kTokenB << " b\n"
        << kTokenC << " c\n"
        << kTokenQ << " q pages=3 sequences=2 steps=1 shm-regions=1\n"
        << kTokenAdmin << " ops\n";
      if (with_late) f << kTokenLate << " late\n";
    }
    std::rename(tmp.c_str(), TokenFile().c_str());
  }
  static void SetUpTestSuite() {
    WriteTokens(false);
    server_ = new ServerProcess(
        ATTND_BINARY,
        {"--model=tiny", "--kv-pages=200", "--threads=2", "--metrics-port=0", "--auth=token",
         "--auth-tokens=" + TokenFile(), "--admin-tenant=ops", "--reload-interval-s=1", "--shm",
         "--shm-socket=" + SocketPath("security"), "--step-idle-timeout-ms=60000"});
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0);
    delete server_;
    std::remove(TokenFile().c_str());
  }
  static std::unique_ptr<Client> As(const std::string& token, bool local = false,
                                    const std::string& act_as = "") {
    ConnectOptions o;
    o.token = token;
    o.act_as_tenant = act_as;
    return Connect(local ? "unix:" + SocketPath("security") : server_->target(), o);
  }
  // Runs every layer of a step on `c` over unary calls.
  absl::Status Commit(Client& c, const client::Batch& batch) {
    int64_t T = 0;
    for (const auto& e : batch) T += e.second;
    auto b = c.BeginStep(batch);
    if (!b.ok()) return b.status();
    for (const auto& l : client::GenerateStep(spec(), T, DType::kBF16, false, rng_)) {
      auto o = c.AttendLayer(b->step_id(), l.wire);
      if (!o.ok()) return o.status();
    }
    return absl::OkStatus();
  }
  const ModelSpec& spec() {
    if (spec_.num_layers() == 0) spec_ = ModelSpecFromProto(As(kTokenA)->Info()->model()).value();
    return spec_;
  }
  // Every exported byte of a sequence (all chunks, all layers).
  static absl::StatusOr<std::string> Export(Client& c, const std::string& id) {
    grpc::ClientContext ctx;
    c.Authorize(&ctx);
    v1::ExportSequenceRequest req;
    req.set_sequence_id(id);
    auto reader = c.stub()->ExportSequence(&ctx, req);
    std::string all;
    v1::ExportChunk chunk;
    while (reader->Read(&chunk)) all += chunk.SerializeAsString();
    const absl::Status s = client::FromGrpc(reader->Finish());
    if (!s.ok()) return s;
    return all;
  }

  static ServerProcess* server_;
  ModelSpec spec_;
  std::mt19937_64 rng_{5};
};
ServerProcess* TokenTest::server_ = nullptr;

TEST_F(TokenTest, AMissingOrWrongTokenIsUnauthenticatedAndNeverEchoed) {
  auto none = As("");
  EXPECT_EQ(InfoStatus(*none).code(), Code::kUnauthenticated);
  EXPECT_EQ(none->OpenStream()->Begin({{"x", 1}}).status().code(), Code::kUnauthenticated);
  EXPECT_EQ(Export(*none, "x").status().code(), Code::kUnauthenticated);
  EXPECT_EQ(none->ListSequences().status().code(), Code::kUnauthenticated);
  const std::string wrong = "wrong-token-0123456789abcdef";
  auto tcp = As(wrong), local = As(wrong, /*local=*/true);
  for (Client* c : {tcp.get(), local.get()}) {
    const absl::Status s = c->OpenSequence("x").status();
    EXPECT_EQ(s.code(), Code::kUnauthenticated) << s;
    EXPECT_EQ(s.message().find(wrong), std::string::npos) << "the token was echoed: " << s;
  }
  auto info = As(kTokenA)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tenant(), "a");
  EXPECT_EQ(info->auth(), "token");
  EXPECT_FALSE(info->admin());
}

TEST_F(TokenTest, TheTokenFileIsReloadedWhenItChanges) {
  EXPECT_EQ(InfoStatus(*As(kTokenLate)).code(), Code::kUnauthenticated);
  WriteTokens(true);
  absl::Status s = absl::UnknownError("not tried");
  for (int i = 0; i < 100 && !s.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s = InfoStatus(*As(kTokenLate));
  }
  EXPECT_TRUE(s.ok()) << "a token added to the file was not accepted within 10 s: " << s;
  WriteTokens(false);  // revoked
  for (int i = 0; i < 100 && s.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s = InfoStatus(*As(kTokenLate));
  }
  EXPECT_EQ(s.code(), Code::kUnauthenticated) << "a revoked token still works after 10 s";
}

// Every RPC that names a sequence, step or region, issued by tenant b against tenant a's
// objects: NOT_FOUND, with exactly the message tenant c (who holds nothing) gets for the same
// name; afterwards a's state is unchanged (lengths, pages, exported keys, open steps usable).
TEST_F(TokenTest, AnotherTenantsObjectsReadAsAbsentAndStayUntouched) {
  auto a = As(kTokenA), a_local = As(kTokenA, true);
  auto b = As(kTokenB), b_local = As(kTokenB, true);
  auto c = As(kTokenC), c_local = As(kTokenC, true);
  const ModelSpec& s = spec();
  ASSERT_TRUE(a->OpenSequence("iso").ok());
  ASSERT_TRUE(Commit(*a, {{"iso", 37}}).ok());
  ASSERT_TRUE(a->OpenSequence("iso-open").ok());
  ASSERT_TRUE(a->OpenSequence("iso-stream").ok());
  ASSERT_TRUE(a->OpenSequence("iso-shard").ok());
  // An open unary step, an open stream step, an open sharded step and a region, all a's.
  auto unary = a->BeginStep({{"iso-open", 3}});
  ASSERT_TRUE(unary.ok()) << unary.status();
  auto stream = a->OpenStream();
  auto streamed = stream->Begin({{"iso-stream", 2}});
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  auto sharded = a->BeginStep({{"iso-shard", 2}}, false, 2);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto mem = client::SharedMemory::Create(absl::StrCat("/attnd-iso-", getpid()), 1 << 20);
  ASSERT_TRUE(mem.ok()) << mem.status();
  ASSERT_TRUE(a_local->RegisterSharedMemory("a-region", (*mem)->key(), 0, 1 << 20).ok());
  const auto before = a->DescribeSequence("iso");
  const auto exported = Export(*a, "iso");
  ASSERT_TRUE(before.ok() && exported.ok()) << exported.status();

  const auto layer0 = client::GenerateStep(s, 1, DType::kBF16, false, rng_)[0].wire;
  struct Case {
    const char* what;
    std::function<absl::Status(Client& remote, Client& local)> call;
  };
  const std::vector<Case> cases = {
      {"DescribeSequence", [](Client& x, Client&) { return x.DescribeSequence("iso").status(); }},
      {"CloseSequence", [](Client& x, Client&) { return x.CloseSequence("iso"); }},
      {"OpenSequence (fork)",
       [](Client& x, Client&) { return x.OpenSequence("mine", "iso", 5).status(); }},
      {"BeginStep",
       [](Client& x, Client&) {
         return x.BeginStep({{"iso", 1}}).status();
       }},
      {"Step stream begin",
       [](Client& x, Client&) {
         return x.OpenStream()->Begin({{"iso", 1}}).status();
       }},
      {"ExportSequence", [](Client& x, Client&) { return Export(x, "iso").status(); }},
      {"AttendLayer (unary step)",
       [&](Client& x, Client&) { return x.AttendLayer(unary->step_id(), layer0).status(); }},
      {"AbortStep (unary step)", [&](Client& x, Client&) { return x.AbortStep(unary->step_id()); }},
      {"AttendLayer (stream step)",
       [&](Client& x, Client&) { return x.AttendLayer(streamed->step_id(), layer0).status(); }},
      {"AbortStep (stream step)",
       [&](Client& x, Client&) { return x.AbortStep(streamed->step_id()); }},
      {"Step stream join (sharded step)",
       [&](Client& x, Client&) { return x.OpenStream()->Join(sharded->step_id(), 1).status(); }},
      {"AbortStep (sharded step)",
       [&](Client& x, Client&) { return x.AbortStep(sharded->step_id()); }},
      {"UnregisterSharedMemory",
       [](Client&, Client& l) { return l.UnregisterSharedMemory("a-region"); }},
      {"a tensor in a's region",
       [&](Client&, Client& l) -> absl::Status {
         const std::string id = absl::StrCat("own-", rng_());
         if (auto o = l.OpenSequence(id); !o.ok()) return o.status();
         auto st = l.BeginStep({{id, 1}});
         if (!st.ok()) return st.status();
         v1::LayerInputs in = layer0;
         *in.mutable_q_rope() =
             client::ShmTensor(DType::kBF16, {1, s.num_heads, s.qk_rope_head_dim}, "a-region", 0);
         const absl::Status r = l.AttendLayer(st->step_id(), in).status();
         (void)l.CloseSequence(id);
         return r;
       }},
  };
  for (const Case& k : cases) {
    const absl::Status by_b = k.call(*b, *b_local);
    const absl::Status by_c = k.call(*c, *c_local);
    EXPECT_EQ(by_b.code(), Code::kNotFound) << k.what << ": " << by_b;
    EXPECT_EQ(by_b.code(), by_c.code()) << k.what;
    EXPECT_EQ(by_b.message(), by_c.message()) << k.what << ": b must learn nothing c would not";
  }
  // a itself may not drive its stream's step over unary calls: the step is bound to the stream.
  EXPECT_EQ(a->AttendLayer(streamed->step_id(), layer0).status().code(), Code::kNotFound);
  // b's and c's "mine" forks failed; b may use the same names in its own namespace.
  ASSERT_TRUE(b->OpenSequence("iso").ok());
  ASSERT_TRUE(Commit(*b, {{"iso", 5}}).ok());
  EXPECT_EQ(b->DescribeSequence("iso")->length(), 5);
  EXPECT_TRUE(b->CloseSequence("iso").ok());

  // a's state is as it was: length, pages, every cached byte, and its open steps go on.
  const auto after = a->DescribeSequence("iso");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->length(), before->length());
  EXPECT_EQ(after->num_pages(), before->num_pages());
  EXPECT_EQ(Export(*a, "iso").value(), *exported) << "a's cached keys changed";
  for (const auto& l : client::GenerateStep(s, 3, DType::kBF16, false, rng_)) {
    auto o = a->AttendLayer(unary->step_id(), l.wire);
    ASSERT_TRUE(o.ok()) << "a's unary step: " << o.status();
  }
  for (const auto& l : client::GenerateStep(s, 2, DType::kBF16, false, rng_)) {
    auto o = stream->Layer(l.wire);
    ASSERT_TRUE(o.ok()) << "a's stream step: " << o.status();
  }
  EXPECT_EQ(a->DescribeSequence("iso-open")->length(), 3);
  EXPECT_EQ(a->DescribeSequence("iso-stream")->length(), 2);
  EXPECT_TRUE(a->AbortStep(sharded->step_id()).ok()) << "a's sharded step was still open";
  EXPECT_TRUE(a_local->UnregisterSharedMemory("a-region").ok()) << "a's region was still there";
  EXPECT_TRUE(stream->Close().ok());
  for (const char* id : {"iso", "iso-open", "iso-stream", "iso-shard"})
    EXPECT_TRUE(a->CloseSequence(id).ok()) << id;
}

TEST_F(TokenTest, QuotasRefuseWithTheQuotaNamedAndLeaveOthersAlone) {
  auto q = As(kTokenQ), q_local = As(kTokenQ, true), a = As(kTokenA);
  const int page = spec().page_size;
  auto expect_quota = [](const absl::Status& s, const char* quota) {
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(absl::StrCat("tenant quota ", quota)), std::string::npos) << s;
  };
  ASSERT_TRUE(q->OpenSequence("q1").ok());
  ASSERT_TRUE(q->OpenSequence("q2").ok());
  expect_quota(q->OpenSequence("q3").status(), "sequences");
  // pages=3: a step needing 4 pages is refused and changes nothing; 3 pages fit.
  expect_quota(q->BeginStep({{"q1", 4 * page}}).status(), "pages");
  EXPECT_EQ(q->DescribeSequence("q1")->num_pages(), 0);
  ASSERT_TRUE(Commit(*q, {{"q1", 2 * page}}).ok());
  expect_quota(q->OpenSequence("q3", "q1", 2 * page).status(), "sequences");
  ASSERT_TRUE(q->CloseSequence("q2").ok());
  expect_quota(q->OpenSequence("q2", "q1", 2 * page).status(), "pages");  // 2 + 2 > 3
  // steps=1: a second open step is refused.
  auto open = q->BeginStep({{"q1", 1}});
  ASSERT_TRUE(open.ok()) << open.status();
  ASSERT_TRUE(q->OpenSequence("q2").ok());
  expect_quota(q->BeginStep({{"q2", 1}}).status(), "steps");
  ASSERT_TRUE(q->AbortStep(open->step_id()).ok());
  // shm-regions=1.
  auto mem = client::SharedMemory::Create(absl::StrCat("/attnd-quota-", getpid()), 4096);
  ASSERT_TRUE(mem.ok());
  ASSERT_TRUE(q_local->RegisterSharedMemory("r1", (*mem)->key(), 0, 4096).ok());
  expect_quota(q_local->RegisterSharedMemory("r2", (*mem)->key(), 0, 4096), "shm-regions");
  // Another tenant is untouched by q's quotas: more sequences, pages and steps than q may hold.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(a->OpenSequence(absl::StrCat("qa", i)).ok());
  ASSERT_TRUE(Commit(*a, {{"qa0", 4 * page}, {"qa1", 1}}).ok());
  auto s1 = a->BeginStep({{"qa0", 1}}), s2 = a->BeginStep({{"qa2", 1}});
  EXPECT_TRUE(s1.ok() && s2.ok());
  EXPECT_TRUE(a->AbortStep(s1->step_id()).ok() && a->AbortStep(s2->step_id()).ok());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(a->CloseSequence(absl::StrCat("qa", i)).ok());
  EXPECT_TRUE(q_local->UnregisterSharedMemory("r1").ok());
  EXPECT_TRUE(q->CloseSequence("q1").ok());
  EXPECT_TRUE(q->CloseSequence("q2").ok());
}

// A standby copy in a tenant's namespace (placed by the replicas' admin identity, paid for by
// the standby budget) is written only by that identity: the tenant's own write-only step would
// take pages past its quota. The replicas' steps on copies count against neither the tenant's
// pages nor its open steps (a tenant at its step quota cannot stall its own replication).
TEST_F(TokenTest, AStandbyCopyIsWrittenOnlyByTheReplicasNotItsTenant) {
  auto q = As(kTokenQ), as_q = As(kTokenAdmin, false, "q");
  const int page = spec().page_size;
  v1::OpenSequenceRequest open;
  open.set_sequence_id("sb");
  open.set_standby_generation(1);
  ASSERT_TRUE(as_q->OpenSequence(open).ok());
  EXPECT_EQ(q->OpenSequence(open).status().code(), Code::kPermissionDenied);
  auto denied = q->BeginStep({{"sb", 4 * page}}, /*write_only=*/true);
  EXPECT_EQ(denied.status().code(), Code::kPermissionDenied) << denied.status();
  EXPECT_NE(denied.status().message().find("standby copy"), std::string::npos) << denied.status();
  EXPECT_EQ(q->BeginStep({{"sb", 1}}).status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(q->DescribeSequence("sb")->num_pages(), 0);
  // q holds its one open step (steps=1); the replicas still write its copy, 4 pages past pages=3.
  ASSERT_TRUE(q->OpenSequence("q1").ok());
  auto held = q->BeginStep({{"q1", 1}});
  ASSERT_TRUE(held.ok()) << held.status();
  auto copy = as_q->BeginStep({{"sb", 4 * page}}, /*write_only=*/true);
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(q->OpenSequence("q2").ok());
  EXPECT_EQ(q->BeginStep({{"q2", 1}}).status().code(), Code::kResourceExhausted) << "steps=1";
  ASSERT_TRUE(as_q->AbortStep(copy->step_id()).ok());
  ASSERT_TRUE(q->AbortStep(held->step_id()).ok());
  auto next = q->BeginStep({{"q2", 1}});  // the copy's step returned nothing of q's
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(q->AbortStep(next->step_id()).ok());
  EXPECT_TRUE(as_q->CloseSequence("sb", 1).ok());
  EXPECT_TRUE(q->CloseSequence("q1").ok());
  EXPECT_TRUE(q->CloseSequence("q2").ok());
}

// Issue 53: a tenant closed its own standby copy (a plain close), and the replica holding the
// primary went on reporting it "replicated". Copies are closed by the replicas alone, at their
// generation; the tenant's close, plain or naming the generation, leaves the copy as it was.
TEST_F(TokenTest, AStandbyCopyIsClosedOnlyByTheReplicas) {
  auto q = As(kTokenQ), as_q = As(kTokenAdmin, false, "q");
  v1::OpenSequenceRequest open;
  open.set_sequence_id("sb-close");
  open.set_standby_generation(3);
  ASSERT_TRUE(as_q->OpenSequence(open).ok());
  const absl::Status plain = q->CloseSequence("sb-close");
  EXPECT_EQ(plain.code(), Code::kFailedPrecondition) << plain;
  EXPECT_NE(plain.message().find("standby copy"), std::string::npos) << plain;
  EXPECT_EQ(q->CloseSequence("sb-close", 3).code(), Code::kPermissionDenied);
  auto still = as_q->DescribeSequence("sb-close");
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_TRUE(still->standby());
  EXPECT_EQ(as_q->CloseSequence("sb-close").code(), Code::kFailedPrecondition)
      << "the replicas name the generation too";
  EXPECT_TRUE(as_q->CloseSequence("sb-close", 3).ok());
  EXPECT_EQ(q->DescribeSequence("sb-close").status().code(), Code::kNotFound);
}

TEST_F(TokenTest, TheAdminListsEveryTenantAndMayActAsOne) {
  auto a = As(kTokenA), b = As(kTokenB), admin = As(kTokenAdmin);
  ASSERT_TRUE(a->OpenSequence("adm-a").ok());
  ASSERT_TRUE(b->OpenSequence("adm-b").ok());
  auto mine = a->ListSequences();
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->sequences_size(), 1);
  EXPECT_EQ(mine->sequences(0).sequence_id(), "adm-a");
  EXPECT_EQ(mine->sequences(0).tenant(), "") << "a's own listing names no tenant";
  EXPECT_EQ(a->ListSequences(true).status().code(), Code::kPermissionDenied);
  auto all = admin->ListSequences(true);
  ASSERT_TRUE(all.ok()) << all.status();
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& sq : all->sequences()) seen.insert({sq.tenant(), sq.sequence_id()});
  EXPECT_TRUE(seen.count({"a", "adm-a"}) && seen.count({"b", "adm-b"}));
  EXPECT_TRUE(admin->Info()->admin());
  // Acting as a: a's namespace (e.g. handing its sequences off); others may not.
  auto as_a = As(kTokenAdmin, false, "a");
  EXPECT_TRUE(as_a->DescribeSequence("adm-a").ok());
  EXPECT_EQ(as_a->DescribeSequence("adm-b").status().code(), Code::kNotFound);
  EXPECT_EQ(As(kTokenB, false, "a")->DescribeSequence("adm-a").status().code(),
            Code::kPermissionDenied);
  EXPECT_TRUE(as_a->CloseSequence("adm-a").ok());
  EXPECT_TRUE(b->CloseSequence("adm-b").ok());
}

TEST_F(TokenTest, StepIdsAreRandomSixtyFourBitValues) {
  auto a = As(kTokenA);
  ASSERT_TRUE(a->OpenSequence("rnd").ok());
  std::vector<uint64_t> ids;
  for (int i = 0; i < 16; ++i) {
    auto st = a->BeginStep({{"rnd", 1}});
    ASSERT_TRUE(st.ok());
    ids.push_back(st->step_id());
    ASSERT_TRUE(a->AbortStep(st->step_id()).ok());
  }
  // Sequential ids would all fit in a few bits and differ by 1; random ones use all 64.
  int high = 0, consecutive = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    high += ids[i] >> 48 != 0;
    if (i > 0) consecutive += ids[i] == ids[i - 1] + 1;
  }
  EXPECT_GE(high, 12) << "fewer than 12 of 16 ids use the top 16 bits";
  EXPECT_EQ(consecutive, 0);
  EXPECT_TRUE(a->CloseSequence("rnd").ok());
}

TEST_F(TokenTest, SharedMemoryOnlyOverTheSocketOnlyForTheCallersOwnObjects) {
  auto a = As(kTokenA), a_local = As(kTokenA, true);
  const ModelSpec& s = spec();
  const std::string key = absl::StrCat("/attnd-sec-", getpid());
  auto mem = client::SharedMemory::Create(key, 1 << 20);
  ASSERT_TRUE(mem.ok());
  // Over TCP: refused, whatever the object.
  const absl::Status tcp = a->RegisterSharedMemory("r", key, 0, 1 << 20);
  EXPECT_EQ(tcp.code(), Code::kPermissionDenied) << tcp;
  // Outside the allowed prefix (and any path trick): refused before anything is opened.
  for (const std::string& bad : {std::string("/other-object"), std::string("/attnd-../x")})
    EXPECT_EQ(a_local->RegisterSharedMemory("r", bad, 0, 16).code(), Code::kPermissionDenied)
        << bad;
  // The owner over the socket: inputs from the region, the output into it, end to end.
  ASSERT_TRUE(a_local->RegisterSharedMemory("mine", key, 0, 1 << 20).ok());
  ASSERT_TRUE(a_local->OpenSequence("shm-x").ok());
  ASSERT_TRUE(a_local->OpenSequence("shm-y").ok());
  const int64_t T = 4;
  auto g = client::GenerateStep(s, T, DType::kBF16, false, rng_);
  auto bx = a_local->BeginStep({{"shm-x", T}});
  auto by = a_local->BeginStep({{"shm-y", T}});
  ASSERT_TRUE(bx.ok() && by.ok());
  const int64_t out_bytes = T * s.num_heads * s.kv_lora_rank * 2;
  for (const auto& l : g) {
    v1::LayerInputs in = l.wire;
    const std::string& q = in.q_latent().data();
    std::memcpy((*mem)->data(), q.data(), q.size());
    *in.mutable_q_latent() =
        client::ShmTensor(DType::kBF16, {T, s.num_heads, s.kv_lora_rank}, "mine", 0);
    in.mutable_out_shm()->set_region("mine");
    in.mutable_out_shm()->set_offset(512 << 10);
    in.mutable_out_shm()->set_byte_size(out_bytes);
    auto via_shm = a_local->AttendLayer(bx->step_id(), in);
    auto via_bytes = a_local->AttendLayer(by->step_id(), l.wire);
    ASSERT_TRUE(via_shm.ok() && via_bytes.ok()) << via_shm.status() << via_bytes.status();
    EXPECT_TRUE(via_shm->out().data().empty()) << "the output went to the region";
    ASSERT_EQ(via_bytes->out().data().size(), static_cast<size_t>(out_bytes));
    EXPECT_EQ(std::memcmp((*mem)->data() + (512 << 10), via_bytes->out().data().data(), out_bytes),
              0)
        << "layer " << l.wire.layer();
  }
  EXPECT_TRUE(a_local->UnregisterSharedMemory("mine").ok());
  EXPECT_TRUE(a_local->CloseSequence("shm-x").ok());
  EXPECT_TRUE(a_local->CloseSequence("shm-y").ok());
}

// An object owned by another user is refused even though the server's user could open it.
TEST_F(TokenTest, AnObjectOwnedByAnotherUserCannotBeRegistered) {
  if (geteuid() != 0) GTEST_SKIP() << "making an object owned by another user needs root (CI is)";
  auto a_local = As(kTokenA, true);
  const std::string foreign = absl::StrCat("/attnd-foreign-", getpid());
  const int fd = shm_open(foreign.c_str(), O_CREAT | O_EXCL | O_RDWR, 0666);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(fchown(fd, 65534, 65534), 0);  // nobody's
  const absl::Status st = a_local->RegisterSharedMemory("f", foreign, 0, 4096);
  EXPECT_EQ(st.code(), Code::kPermissionDenied) << st;
  EXPECT_NE(st.message().find("owned by the calling user"), std::string::npos) << st;
  // The same object owned by the caller registers.
  ASSERT_EQ(fchown(fd, geteuid(), getegid()), 0);
  EXPECT_TRUE(a_local->RegisterSharedMemory("f", foreign, 0, 4096).ok());
  EXPECT_TRUE(a_local->UnregisterSharedMemory("f").ok());
  close(fd);
  shm_unlink(foreign.c_str());
}

}  // namespace
}  // namespace attnd::testing
