// The UCX data plane's two ends in one process, for its tests (ucx_plane_test.cc,
// ucx_plane_push_test.cc): a server plane and a client attached to it.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/ucx_plane.h"
#include "transport/ucx_plane_client.h"

namespace attnd::transport {

inline std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

struct Pair {
  std::unique_ptr<UcxPlane> server;
  std::unique_ptr<UcxPlaneClient> client;
  UcxPlane::Connection conn;
};

// With `give_address` the client gives its worker's address in the handshake, and a server with
// `push` sends it outputs as they are built (ucx_plane_push_test.cc).
inline Pair Connect(int64_t in_bytes = 1 << 20, int64_t out_bytes = 1 << 20,
                    absl::Duration timeout = absl::Seconds(2), bool give_address = false,
                    bool push = true) {
  UcxPlane::Options o;
  o.transfer_timeout = timeout;
  o.max_region_bytes = 8 << 20;
  o.push = push;
  Pair p;
  auto server = UcxPlane::Create(o);
  EXPECT_TRUE(server.ok()) << server.status();
  p.server = std::move(*server);
  auto client = UcxPlaneClient::Create(out_bytes);
  EXPECT_TRUE(client.ok()) << client.status();
  p.client = std::move(*client);
  auto conn = p.server->Connect("tenant-a", in_bytes, out_bytes, 0,
                                give_address ? p.client->address() : "");
  EXPECT_TRUE(conn.ok()) << conn.status();
  p.conn = *conn;
  EXPECT_TRUE(
      p.client->Attach(conn->id, conn->token, conn->server_address, in_bytes, conn->pushes).ok());
  return p;
}

// How long a direct Read waits for its transfer: the plane's timeout, as a call's wait for its
// inputs (the service's own reads wait for nothing: AfterLandings waited first).
inline absl::Time Patience(const Pair& p) {
  return absl::Now() + p.server->options().transfer_timeout;
}

inline std::string ReadBack(Pair& p, int64_t offset, size_t n, uint64_t transfer,
                            absl::Status* status) {
  auto r = p.server->Resolve("tenant-a", "q", p.conn.input_region, offset, n);
  if (!r.ok()) {
    *status = r.status();
    return "";
  }
  std::string got(n, '\0');
  *status = (*r)->Read(offset, got.data(), n, transfer, Patience(p));
  return got;
}

}  // namespace attnd::transport
