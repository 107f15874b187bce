#include "client/router.h"

#include <gtest/gtest.h>

#include <map>

#include "absl/strings/str_cat.h"

namespace attnd::client {
namespace {

std::vector<std::string> Endpoints(int n) {
  std::vector<std::string> e;
  for (int i = 0; i < n; ++i) e.push_back(absl::StrCat("10.0.0.", i + 1, ":50051"));
  return e;
}

TEST(Router, SpreadsSequencesEvenlyAndDeterministically) {
  const auto eps = Endpoints(4);
  std::map<std::string, int> count;
  for (int i = 0; i < 20000; ++i) ++count[Route(eps, absl::StrCat("req-", i))];
  ASSERT_EQ(count.size(), 4u);
  for (const auto& [e, n] : count) EXPECT_NEAR(n, 5000, 400) << e;
  // Order of the endpoint list does not matter.
  auto shuffled = eps;
  std::reverse(shuffled.begin(), shuffled.end());
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(Route(eps, absl::StrCat("s", i)), Route(shuffled, absl::StrCat("s", i)));
  EXPECT_EQ(Route({}, "x"), "");
}

TEST(Router, OnlySequencesOfARemovedReplicaMove) {
  const auto eps = Endpoints(5);
  auto fewer = eps;
  fewer.erase(fewer.begin() + 2);
  int moved = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string id = absl::StrCat("seq/", i);
    const std::string before = Route(eps, id), after = Route(fewer, id);
    if (before != eps[2]) {
      EXPECT_EQ(before, after) << id;
    } else {
      ++moved;
    }
  }
  EXPECT_NEAR(moved, 1000, 150);
}

TEST(Router, RankedStartsAtTheOwnerAndEachNextIsTheOwnerWithoutThoseBefore) {
  const auto eps = Endpoints(5);
  for (int i = 0; i < 200; ++i) {
    const std::string id = absl::StrCat("r", i);
    std::vector<std::string> rest = eps;
    const std::vector<std::string> ranked = Ranked(eps, id);
    ASSERT_EQ(ranked.size(), eps.size());
    for (const std::string& next : ranked) {
      EXPECT_EQ(Route(rest, id), next) << id;  // where a drain of those before sends it
      rest.erase(std::find(rest.begin(), rest.end(), next));
    }
  }
  EXPECT_TRUE(Ranked({}, "x").empty());
}

TEST(Router, KnownWeightsMatchThePythonClient) {
  // Pinned values: client/python/tests/test_router.py checks the same numbers.
  EXPECT_EQ(RendezvousWeight("10.0.0.1:50051", "req-1"), 0x8bf57d503040d621ull);
  EXPECT_EQ(Route(Endpoints(3), "req-1"), "10.0.0.1:50051");
  EXPECT_EQ(Route(Endpoints(3), "req-2"), "10.0.0.2:50051");
  EXPECT_EQ(RendezvousWeight("10.0.0.3:50051", "decode/42"), 0x4b2d243253b373a9ull);
}

TEST(Router, RouterKeepsClientsOfEndpointsThatStay) {
  Router r(Endpoints(3));
  Client* a = r.ClientFor("req-1");
  ASSERT_NE(a, nullptr);
  const std::string owner = r.Pick("req-1");
  auto eps = Endpoints(3);
  eps.push_back("10.0.0.9:50051");
  r.SetEndpoints(eps);
  if (r.Pick("req-1") == owner) {
    EXPECT_EQ(r.ClientFor("req-1"), a);
  }
  EXPECT_EQ(r.endpoints().size(), 4u);
  auto local = ResolveEndpoints("localhost", 50051);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_FALSE(local->empty());
}

}  // namespace
}  // namespace attnd::client
