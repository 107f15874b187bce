// Which gRPC targets are this host's (IsLocalTarget): a data plane to such a server keeps the
// client's UCX on the loopback interfaces, so no other host reaches the port UCX's TCP transport
// opens (docs/trust.md). The Python client's local_target reads targets the same way
// (test_data_plane.py checks the two agree on these cases).
#include <gtest/gtest.h>

#include <string>

#include "client/attnd_client.h"

namespace attnd::client {
namespace {

TEST(ClientTarget, TargetsOnThisHostAreLocal) {
  for (const std::string t :
       {"localhost:50051", "127.0.0.1:50051", "127.5.6.7:1", "[::1]:50051", "dns:///localhost:1",
        "dns:localhost:1", "ipv4:127.0.0.1:50051", "ipv6:[::1]:50051", "unix:/run/attnd.sock",
        "unix-abstract:attnd", "localhost", "127.0.0.1", "::1"})
    EXPECT_TRUE(IsLocalTarget(t)) << t;
}

TEST(ClientTarget, OtherHostsAndLookAlikesAreNot) {
  for (const std::string t :
       {"10.0.0.5:50051", "attnd.default.svc:50051", "dns:///attnd-0.attnd:50051",
        "ipv4:192.0.2.2:50051", "[2001:db8::1]:50051", "localhost.example.com:1",
        "127.example.com:50051", "1.127.0.0:1", "[::2]:1", "", "dns:///:50051"})
    EXPECT_FALSE(IsLocalTarget(t)) << t;
}

}  // namespace
}  // namespace attnd::client
