#include "client/router.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

PrefixCandidate Candidate(std::string name, int64_t cached, int64_t free, int64_t total,
                          int64_t busy) {
  PrefixCandidate c;
  c.name = std::move(name);
  c.cached_blocks = cached;
  c.free_pages = free;
  c.total_pages = total;
  c.busy = busy;
  return c;
}

// The rule: cache × the prompt's fraction held + free × the device's fraction free − load × busy /
// (the busiest + 1); an unreachable replica only when none answers; equal scores: the rendezvous
// owner.
TEST(PrefixChoice, WeighsTheCachedPromptAgainstRoomAndWork) {
  EXPECT_EQ(ChoosePrefixReplica({}, "s"), "");
  // Equal room and work: the longest cached run.
  EXPECT_EQ(ChoosePrefixReplica({Candidate("a", 2, 50, 100, 0), Candidate("b", 3, 50, 100, 0),
                                 Candidate("c", 1, 50, 100, 0)},
                                "s", 4),
            "b");
  // A replica that did not answer loses to any that did, whatever it holds.
  EXPECT_EQ(
      ChoosePrefixReplica({Candidate("a", 0, 0, 100, 5), Candidate("b", 4, -1, 0, 0)}, "s", 4),
      "a");
  EXPECT_EQ(ChoosePrefixReplica({Candidate("a", 1, -1, 0, 0), Candidate("b", 4, -1, 0, 0)}, "s", 4),
            "b");
  // The defaults (cache 1, free 2): a small cached share (1 of 8 blocks, 0.125, and 60% free:
  // 1.325) loses to room (90% free: 1.8); a long one (7 of 8: 0.875 + 1.2) wins against it.
  EXPECT_EQ(
      ChoosePrefixReplica({Candidate("a", 1, 60, 100, 0), Candidate("b", 0, 90, 100, 0)}, "s", 8),
      "b");
  EXPECT_EQ(
      ChoosePrefixReplica({Candidate("a", 7, 60, 100, 0), Candidate("b", 0, 90, 100, 0)}, "s", 8),
      "a");
  // Work: the same cache and room, 3 open steps against none.
  EXPECT_EQ(
      ChoosePrefixReplica({Candidate("a", 2, 50, 100, 3), Candidate("b", 2, 50, 100, 0)}, "s", 4),
      "b");
  // Only the cache weighed: room and work change nothing.
  const PrefixWeights cache_only{1.0, 0.0, 0.0};
  EXPECT_EQ(ChoosePrefixReplica({Candidate("a", 2, 0, 100, 9), Candidate("b", 1, 100, 100, 0)}, "s",
                                4, cache_only),
            "a");
  // Equal everything: the rendezvous owner, for every id.
  for (int i = 0; i < 32; ++i) {
    const std::string id = absl::StrCat("s", i);
    EXPECT_EQ(ChoosePrefixReplica({Candidate("a", 0, 5, 10, 0), Candidate("b", 0, 5, 10, 0),
                                   Candidate("c", 0, 5, 10, 0)},
                                  id),
              Route({"a", "b", "c"}, id));
  }
}

// Both clients choose alike: tests/data/prefix_scores.txt, written by the Python client's
// attnd.score_replicas (client/python/tests/test_prefix_router.py checks it reproduces them).
TEST(PrefixChoice, ChoosesWhatThePythonClientChooses) {
  std::ifstream f(std::string(ATTND_SOURCE_DIR) + "/tests/data/prefix_scores.txt");
  ASSERT_TRUE(f.good());
  std::string line;
  int cases = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> w = absl::StrSplit(line, ' ');
    ASSERT_GE(w.size(), 7u) << line;
    int64_t blocks = 0;
    PrefixWeights weights;
    ASSERT_TRUE(absl::SimpleAtoi(w[1], &blocks) && absl::SimpleAtod(w[2], &weights.cache) &&
                absl::SimpleAtod(w[3], &weights.free) && absl::SimpleAtod(w[4], &weights.load))
        << line;
    std::vector<PrefixCandidate> candidates;
    for (size_t i = 6; i < w.size(); ++i) {
      const std::vector<std::string> f5 = absl::StrSplit(w[i], ':');
      ASSERT_EQ(f5.size(), 5u) << line;
      PrefixCandidate c;
      c.name = f5[0];
      ASSERT_TRUE(absl::SimpleAtoi(f5[1], &c.cached_blocks) &&
                  absl::SimpleAtoi(f5[2], &c.free_pages) &&
                  absl::SimpleAtoi(f5[3], &c.total_pages) && absl::SimpleAtoi(f5[4], &c.busy))
          << line;
      candidates.push_back(c);
    }
    EXPECT_EQ(ChoosePrefixReplica(candidates, w[0], blocks, weights), w[5]) << line;
    ++cases;
  }
  EXPECT_GE(cases, 50);
}

}  // namespace
}  // namespace attnd::client
