// Outputs pushed: a client that gives its worker address in the handshake gets each output as
// soon as the server builds it, without asking, and takes only outputs of calls it waits for
// (docs/data-plane.md). Built into ucx_plane_test, so these run under UCX's default transports,
// UCX_TLS=sm and UCX_TLS=tcp too.
#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/unit/ucx_plane_pair.h"

namespace attnd::transport {
namespace {

// A pair whose client gave its worker address (and, with `push` off on the server, whose
// server declined to use it).
Pair ConnectPushing(bool push = true, absl::Duration timeout = absl::Seconds(2),
                    int64_t region_bytes = 1 << 20) {
  return Connect(region_bytes, region_bytes, timeout, /*give_address=*/true, push);
}

// Builds `bytes` as output `transfer` at `at` of the plane's output region (as a layer does).
void Build(Pair& p, int64_t at, const std::string& bytes, uint64_t transfer) {
  auto r = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, at, bytes.size());
  ASSERT_TRUE(r.ok()) << r.status();
  char* staged = (*r)->Staging(at, bytes.size());
  std::memcpy(staged, bytes.data(), bytes.size());
  ASSERT_TRUE((*r)->Write(at, staged, bytes.size(), transfer).ok());
}

TEST(UcxPush, OutputsArriveUnaskedEagerAndByRendezvous) {
  Pair p = ConnectPushing();
  ASSERT_TRUE(p.conn.pushes);
  int64_t sent = 0;
  for (size_t n : {size_t{200}, size_t{700} << 10}) {
    const std::string out = RandomBytes(n, n + 1);
    const int64_t at = p.client->output_space().Take(n);
    ASSERT_GE(at, 0);
    const uint64_t t = p.client->NextTransfer();
    p.client->Want(t);
    Build(p, at, out, t);
    sent += static_cast<int64_t>(n);
    auto got = p.client->Await(t, at, n, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::string(*got, n), out);
    p.client->output_space().Give(at);
  }
  EXPECT_EQ(p.server->bytes_out(), sent);
  // Into a buffer the caller named (StepStream::Layer's form).
  const std::string out = RandomBytes(300 << 10, 5);
  std::string dest(out.size(), '\0');
  const uint64_t t = p.client->NextTransfer();
  p.client->Want(t);
  p.client->Expect(t, dest.data(), dest.size());
  Build(p, 4096, out, t);
  auto got = p.client->Await(t, 4096, out.size(), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, dest.data());
  EXPECT_EQ(dest, out);
}

TEST(UcxPush, AnOutputTheClientDoesNotWaitForIsDroppedUnwritten) {
  // A call given up on (its deadline passed, its space handed to another call) may still get its
  // output: it must not land over the space's new owner.
  Pair p = ConnectPushing();
  ASSERT_TRUE(p.conn.pushes);
  const size_t n = 256 << 10;
  const std::string late = RandomBytes(n, 11), fresh = RandomBytes(n, 12);
  const uint64_t given_up = p.client->NextTransfer();
  p.client->Want(given_up);
  p.client->Forget(given_up);
  Build(p, 0, late, given_up);
  const uint64_t never = p.client->NextTransfer();  // never asked for at all
  Build(p, n, late, never);
  // Sent after both on the same endpoint: once it landed, both were handled (UCX keeps a
  // sender's order of active messages).
  const uint64_t t = p.client->NextTransfer();
  p.client->Want(t);
  Build(p, 2 * n, fresh, t);
  auto got = p.client->Await(t, 2 * n, n, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(*got, n), fresh);
  const char* region = *got - 2 * n;  // the client's output region
  EXPECT_NE(std::string(region, n), late);
  EXPECT_NE(std::string(region + n, n), late);
  for (uint64_t gone : {given_up, never})
    EXPECT_EQ(p.client->Await(gone, 0, n, absl::Now() + absl::Milliseconds(50)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
}

TEST(UcxPush, NoPushedByteLandsAfterForgetReturns) {
  // A call given up on has its space handed to the next call once Forget returns: a push of its
  // output already being received is waited out, one not yet begun is dropped. Forgotten at
  // moments from before the push's first byte to after its last, the region never changes once
  // Forget returned.
  const size_t n = 8 << 20;
  Pair p = ConnectPushing(true, absl::Seconds(2), n);
  ASSERT_TRUE(p.conn.pushes);
  const std::string old_bytes = RandomBytes(n, 21), new_bytes = RandomBytes(n, 22);
  const uint64_t first = p.client->NextTransfer();
  p.client->Want(first);
  Build(p, 0, old_bytes, first);
  auto got = p.client->Await(first, 0, n, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  const char* region = *got;
  for (int delay_us : {0, 20, 50, 100, 200, 400, 800, 1600, 3200}) {
    // The region holds old_bytes (pushed and awaited) as each round begins.
    const uint64_t gone = p.client->NextTransfer();
    p.client->Want(gone);
    Build(p, 0, new_bytes, gone);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    p.client->Forget(gone);
    const std::string after(region, n);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_TRUE(std::string(region, n) == after) << "written after Forget; delay " << delay_us;
    EXPECT_TRUE(after == old_bytes || after == new_bytes) << "a part landed; delay " << delay_us;
    const uint64_t back = p.client->NextTransfer();
    p.client->Want(back);
    Build(p, 0, old_bytes, back);
    ASSERT_TRUE(p.client->Await(back, 0, n, absl::Now() + absl::Seconds(5)).ok());
  }
}

TEST(UcxPush, AServerWithPushOffAndAClientWithoutAnAddressPull) {
  for (bool gave_address : {true, false}) {
    Pair p = gave_address ? ConnectPushing(/*push=*/false) : Connect();
    EXPECT_FALSE(p.conn.pushes);
    const std::string out = RandomBytes(100 << 10, 3);
    const uint64_t t = p.client->NextTransfer();
    p.client->Want(t);  // nothing for a client that pulls
    Build(p, 0, out, t);
    auto got = p.client->Await(t, 0, out.size(), absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::string(*got, out.size()), out);
  }
}

TEST(UcxPush, AClientWhoseWorkerCannotBeReachedGetsAPlaneItPullsFrom) {
  // The address of a worker that is gone: the plane's connect to it fails, and the handshake
  // answers with a plane the client pulls from, which serves (the failed try's endpoint error
  // does not end it), through the asynchronous handshake as through the waiting one.
  UcxPlane::Options o;
  o.push = true;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::string gone;
  {
    auto ghost = UcxPlaneClient::Create(1 << 20);
    ASSERT_TRUE(ghost.ok()) << ghost.status();
    gone = (*ghost)->address();
  }
  for (bool waiting : {true, false}) {
    absl::StatusOr<UcxPlane::Connection> conn;
    const absl::Time t0 = absl::Now();
    if (waiting) {
      conn = (*server)->Connect("tenant-a", 1 << 20, 1 << 20, 0, gone);
    } else {
      std::promise<absl::StatusOr<UcxPlane::Connection>> answered;
      (*server)->Connect("tenant-a", 1 << 20, 1 << 20, 0, gone, /*keepalives=*/false,
                         [&](absl::StatusOr<UcxPlane::Connection> c) { answered.set_value(c); });
      conn = answered.get_future().get();
    }
    ASSERT_TRUE(conn.ok()) << conn.status();
    EXPECT_FALSE(conn->pushes);
    EXPECT_LE(absl::Now() - t0, UcxWorker::kConnectLimit + absl::Seconds(1));
    auto client = UcxPlaneClient::Create(1 << 20);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE(
        (*client)->Attach(conn->id, conn->token, conn->server_address, 1 << 20, false).ok());
    Pair p{std::move(*server), std::move(*client), *conn};
    const std::string out = RandomBytes(200 << 10, waiting ? 7 : 8);
    const uint64_t t = p.client->NextTransfer();
    Build(p, 0, out, t);
    auto got = p.client->Await(t, 0, out.size(), absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::string(*got, out.size()), out);
    ASSERT_TRUE(p.server->Close("tenant-a", conn->name).ok());
    server = std::move(p.server);
  }
  EXPECT_EQ((*server)->num_planes(), 0);
}

TEST(UcxPush, AnAddressBeyondTheBoundIsRefused) {
  auto server = UcxPlane::Create({});
  ASSERT_TRUE(server.ok());
  auto c = (*server)->Connect("tenant-a", 4096, 4096, 0,
                              RandomBytes(UcxPlane::kMaxClientAddressBytes + 1, 1));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("worker_address"), std::string::npos) << c.status();
  EXPECT_EQ((*server)->num_planes(), 0);
}

TEST(UcxPush, AClientThatDiesEndsItsPlaneAndTheServerServesOn) {
  Pair p = ConnectPushing(true, absl::Milliseconds(300));
  ASSERT_TRUE(p.conn.pushes);
  auto out = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, 0, 1 << 20);
  ASSERT_TRUE(out.ok());
  p.client.reset();  // its worker goes with the plane connected
  // Outputs sent to it fail; the plane's endpoint to it fails, and with it the plane: its calls
  // are then refused at once.
  const std::string big = RandomBytes(512 << 10, 4);
  absl::Status covers;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  for (uint64_t t = 1; absl::Now() < until; ++t) {
    covers = (*out)->CheckStillCovers(0, big.size());
    if (!covers.ok()) break;
    char* staged = (*out)->Staging(0, big.size());
    std::memcpy(staged, big.data(), big.size());
    (void)(*out)->Write(0, staged, big.size(), t);
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(covers.code(), absl::StatusCode::kUnavailable) << covers;
  EXPECT_NE(covers.message().find("endpoint to the client failed"), std::string::npos) << covers;
  // Another client connects and is served; the dead client's plane, no longer of use, goes to
  // make room (it counted against the limits until then).
  EXPECT_EQ(p.server->num_planes(), 1);
  auto fresh = UcxPlaneClient::Create(1 << 20);
  ASSERT_TRUE(fresh.ok());
  auto conn = p.server->Connect("tenant-a", 1 << 20, 1 << 20, 0, (*fresh)->address());
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_TRUE(conn->pushes);
  EXPECT_EQ(p.server->num_planes(), 1);
  EXPECT_EQ(p.server->Close("tenant-a", p.conn.name).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(p.server->Close("tenant-a", conn->name).ok());
}

}  // namespace
}  // namespace attnd::transport
