// The drain's peer list (cluster/drain.h) and the rejection reasons the service's metrics derive
// from refused calls (a draining server's UNAVAILABLE among them).
#include "cluster/drain.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "cluster/replication.h"
#include "metrics/metrics.h"
#include "service/service_metrics.h"
#include "tests/in_process_service.h"

namespace attnd {
namespace {

TEST(DrainPeers, ExplicitPeersStayAndThisHostsAddressesAreSkipped) {
  auto p = DrainPeers({"10.0.0.7:50051", "peer-b:50051"});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, (std::vector<std::string>{"10.0.0.7:50051", "peer-b:50051"}));
  // A name that resolves only to this host (a headless Service on one node resolves to the pod
  // itself among others): nothing to drain to.
  auto local = DrainPeers({"dns:localhost:50051"});
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(local->empty()) << (*local)[0];
  for (const char* bad : {"dns:no-port", "dns:host:port"})
    EXPECT_EQ(DrainPeers({bad}).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_FALSE(DrainPeers({"dns:no-such-name.invalid:50051"}).ok());
}

// A standby pod restarted at another address leaves its old entry (down) beside the new one:
// copies ranked to it go to the entry that answers, not the dead one (they were assigned to the
// first entry of that name, and never replicated again).
TEST(StandbyPeers, ACopyGoesToTheEntryThatAnswersOfAPeerThatCameBackElsewhere) {
  const std::string id = "seq-7";
  // Which of b, c the hash ranks first for id (after self "a"), with both usable.
  const std::vector<PeerCandidate> both = {{"b", true}, {"c", true}};
  const int first = RankStandby(both, "a", id, "");
  ASSERT_GE(first, 0);
  const std::string name = both[first].name, other = name == "b" ? "c" : "b";
  // The old entry of `name` (down), the other peer, the new entry of `name` (up).
  const std::vector<PeerCandidate> restarted = {{name, false}, {other, true}, {name, true}};
  EXPECT_EQ(RankStandby(restarted, "a", id, ""), 2);
  // Only the dead entry: the other peer.
  const std::vector<PeerCandidate> dead = {{name, false}, {other, true}};
  EXPECT_EQ(RankStandby(dead, "a", id, ""), 1);
  // Avoided, or nobody usable: -1 when nothing is left.
  EXPECT_EQ(RankStandby({{name, true}}, "a", id, name), -1);
  EXPECT_EQ(RankStandby({{name, false}, {"", true}}, "a", id, ""), -1);
}

TEST(ServiceMetrics, RefusedSequencesAndStepsCountAsRejectionsByReason) {
  auto engine = testing::TinyEngine(16, 1);
  metrics::Registry registry;
  ServiceMetrics m(&registry, engine.get());
  m.RpcDone("BeginStep", absl::UnavailableError("attnd is draining"), 0.001);
  m.RpcDone("OpenSequence", absl::ResourceExhaustedError("tenant quota sequences: holds 2 of 2"),
            0.001);
  m.RpcDone("BeginStep", absl::ResourceExhaustedError("KV cache full on cpu:0"), 0.001);
  m.RpcDone("Step", absl::OutOfRangeError("length 10 + q_len 9000 exceeds max_context 4096"),
            0.001);
  m.RpcDone("CloseSequence", absl::UnavailableError("x"), 0.001);  // an error, not a rejection
  m.RpcDone("DescribeSequence", absl::OkStatus(), 0.001);
  const std::string text = registry.Serialize();
  for (const char* reason : {"draining", "quota", "cache_full", "max_context"})
    EXPECT_NE(text.find(std::string("attnd_rejections_total{reason=\"") + reason + "\"} 1"),
              std::string::npos)
        << reason << "\n"
        << text;
  EXPECT_NE(text.find("attnd_rpc_errors_total{code=\"UNAVAILABLE\",method=\"CloseSequence\"} 1"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("attnd_rpc_errors_total{code=\"OK\""), std::string::npos)
      << "OK is not an error";
}

// Every RPC counts by method and code, OK included (the error ratio's denominator); the OK
// series of every method and every rejection reason exist at 0 before their first event.
TEST(ServiceMetrics, RequestTotalsCountEveryCallAndExistBeforeTheFirst) {
  auto engine = testing::TinyEngine(16, 1);
  metrics::Registry registry;
  ServiceMetrics m(&registry, engine.get());
  std::string text = registry.Serialize();
  for (const char* method : {"BeginStep", "AttendLayer", "Step", "Drain", "ServerInfo"})
    EXPECT_NE(
        text.find(absl::StrCat("attnd_rpc_requests_total{code=\"OK\",method=\"", method, "\"} 0")),
        std::string::npos)
        << method << "\n"
        << text;
  for (const char* reason : {"cache_full", "quota", "max_context", "draining", "limit"})
    EXPECT_NE(text.find(absl::StrCat("attnd_rejections_total{reason=\"", reason, "\"} 0")),
              std::string::npos)
        << reason;
  EXPECT_NE(text.find("attnd_rpc_seconds_count{method=\"AttendLayer\"} 0"), std::string::npos)
      << text;
  m.RpcDone("DescribeSequence", absl::OkStatus(), 0.002);
  m.RpcDone("DescribeSequence", absl::OkStatus(), 0.003);
  m.RpcDone("DescribeSequence", absl::NotFoundError("no sequence 'x'"), 0.5);
  text = registry.Serialize();
  // Every call is timed, failed ones included.
  EXPECT_NE(text.find("attnd_rpc_seconds_count{method=\"DescribeSequence\"} 3"), std::string::npos)
      << text;
  EXPECT_NE(text.find("attnd_rpc_seconds_sum{method=\"DescribeSequence\"} 0.505"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("attnd_rpc_requests_total{code=\"OK\",method=\"DescribeSequence\"} 2"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("attnd_rpc_requests_total{code=\"NOT_FOUND\",method=\"DescribeSequence\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("attnd_rpc_errors_total{code=\"NOT_FOUND\",method=\"DescribeSequence\"} 1"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace attnd
