// Keepalives: a client that offers them in the handshake says it lives every
// UcxPlane::Options::keepalive (UcxPlaneClient::KeepAlive), and the plane of one that stopped
// (its process died, leaving no endpoint of the server's to fail) is closed (at the next handshake
// or the server's housekeeping: UcxPlane::CloseIdle) once it was silent three of them; a plane
// whose client offers none keeps the idle rule. Built into ucx_plane_test, so these run under UCX's
// default transports, UCX_TLS=sm and tcp too.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/unit/ucx_plane_pair.h"

namespace attnd::transport {
namespace {

constexpr absl::Duration kKeepalive = absl::Milliseconds(200);

struct End {
  std::unique_ptr<UcxPlaneClient> client;
  UcxPlane::Connection conn;
};

End ConnectEnd(UcxPlane& server, bool keepalives) {
  End e;
  auto client = UcxPlaneClient::Create(1 << 20);
  EXPECT_TRUE(client.ok()) << client.status();
  e.client = std::move(*client);
  auto conn = server.Connect("tenant-a", 1 << 20, 1 << 20, 0, "", keepalives);
  EXPECT_TRUE(conn.ok()) << conn.status();
  e.conn = *conn;
  EXPECT_TRUE(e.client->Attach(conn->id, conn->token, conn->server_address, 1 << 20).ok());
  if (e.conn.keepalive > absl::ZeroDuration()) e.client->KeepAlive(e.conn.keepalive);
  return e;
}

// Bytes the client puts land in its plane's input region.
void ExpectServes(UcxPlane& server, End& e, uint64_t seed) {
  const std::string bytes = RandomBytes(5000, seed);
  const uint64_t t = e.client->NextTransfer();
  ASSERT_TRUE(
      e.client->Put(bytes.data(), bytes.size(), 128, t)->Wait(absl::Now() + absl::Seconds(5)).ok());
  auto in = server.Resolve("tenant-a", "q", e.conn.input_region, 128, bytes.size());
  ASSERT_TRUE(in.ok()) << in.status();
  std::string got(bytes.size(), '\0');
  ASSERT_TRUE((*in)->Read(128, got.data(), got.size(), t, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(got, bytes);
}

TEST(UcxKeepalive, APlaneWhoseClientStoppedSayingItLivesIsClosedAtTheNextHandshake) {
  UcxPlane::Options o;
  o.keepalive = kKeepalive;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  End live = ConnectEnd(**server, true);
  End dying = ConnectEnd(**server, true);
  End quiet = ConnectEnd(**server, false);  // offers none: the idle rule (ten minutes)
  EXPECT_EQ(live.conn.keepalive, kKeepalive);
  EXPECT_EQ(quiet.conn.keepalive, absl::ZeroDuration());
  dying.client.reset();            // its process died: nothing more comes from it
  absl::SleepFor(8 * kKeepalive);  // past three keepalives, however late a wakeup is
  // The next handshake closes the silent plane, and only it.
  End next = ConnectEnd(**server, false);
  EXPECT_EQ((*server)->num_planes(), 3);
  const UcxPlane::ClosedCounts closed = (*server)->closed_counts();
  EXPECT_EQ(closed.silent, 1);
  EXPECT_EQ(closed.idle + closed.closed + closed.stalled + closed.lost, 0);
  EXPECT_EQ((*server)->Close("tenant-a", dying.conn.name).code(), absl::StatusCode::kNotFound);
  uint64_t seed = 40;
  for (End* e : {&live, &quiet, &next}) ExpectServes(**server, *e, ++seed);
}

TEST(UcxKeepalive, CloseIdleClosesASilentPlaneWithNoHandshakeAndOnlyIt) {
  // What the server's housekeeping runs every second: a dead client's plane goes without waiting
  // for another client to connect.
  UcxPlane::Options o;
  o.keepalive = kKeepalive;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  End live = ConnectEnd(**server, true);
  End dying = ConnectEnd(**server, true);
  End quiet = ConnectEnd(**server, false);
  dying.client.reset();
  absl::SleepFor(8 * kKeepalive);
  EXPECT_EQ((*server)->CloseIdle(), 1);
  EXPECT_EQ((*server)->num_planes(), 2);
  EXPECT_EQ((*server)->closed_counts().silent, 1);
  EXPECT_EQ((*server)->Resolve("tenant-a", "q", dying.conn.input_region, 0, 16).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*server)->CloseIdle(), 0);  // the live ones stay, however often it runs
  uint64_t seed = 50;
  for (End* e : {&live, &quiet}) ExpectServes(**server, *e, ++seed);
}

TEST(UcxKeepalive, AServerThatAsksForNoneTellsClientsToSendNone) {
  UcxPlane::Options o;
  o.keepalive = absl::ZeroDuration();  // --data-plane-keepalive-ms=0
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  End e = ConnectEnd(**server, true);
  EXPECT_EQ(e.conn.keepalive, absl::ZeroDuration());
  absl::SleepFor(4 * kKeepalive);
  End next = ConnectEnd(**server, true);
  EXPECT_EQ((*server)->num_planes(), 2);
  ExpectServes(**server, e, 7);
  ASSERT_TRUE((*server)->Close("tenant-a", next.conn.name).ok());
  EXPECT_EQ((*server)->closed_counts().closed, 1);
  EXPECT_EQ((*server)->closed_counts().silent, 0);
}

}  // namespace
}  // namespace attnd::transport
