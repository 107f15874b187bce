// The standby's side of leases (cluster/standby_leases.h): grants per copy, the longest one kept,
// capped at kMaxLeaseMs, rounded up while any of it is left, ended by Release, and expired grants
// swept (the map stays bounded by the copies leased now); a promotion begins only when no lease
// runs (or its primary releases it), and from then on grants are refused until it ends.
#include "cluster/standby_leases.h"

#include <gtest/gtest.h>

#include <thread>

namespace attnd {
namespace {

TEST(StandbyLeases, AGrantRunsItsTimeAndTheLongestOneIsKept) {
  StandbyLeases l;
  const SequenceKey a("t", "a"), b("t", "b"), other_tenant("u", "a");
  EXPECT_EQ(l.Remaining(a).count(), 0);
  EXPECT_TRUE(l.Grant(a, 0));  // no lease asked
  EXPECT_TRUE(l.Grant(a, -5));
  EXPECT_EQ(l.Remaining(a).count(), 0);
  l.Grant(a, 10000);
  const int64_t left = l.Remaining(a).count();
  EXPECT_GT(left, 9000);
  EXPECT_LE(left, 10000);
  EXPECT_EQ(l.Remaining(b).count(), 0);
  EXPECT_EQ(l.Remaining(other_tenant).count(), 0) << "a tenant's grant is its own";
  l.Grant(a, 1);  // a shorter one does not cut it short
  EXPECT_GT(l.Remaining(a).count(), 9000);
  l.Grant(b, StandbyLeases::kMaxLeaseMs * 10);
  EXPECT_LE(l.Remaining(b).count(), StandbyLeases::kMaxLeaseMs);
  l.Release(a);
  EXPECT_EQ(l.Remaining(a).count(), 0);
  EXPECT_EQ(l.size(), 1);
}

TEST(StandbyLeases, AShortGrantRunsOutAndIsSwept) {
  StandbyLeases l;
  const SequenceKey a("", "a");
  l.Grant(a, 30);
  EXPECT_GT(l.Remaining(a).count(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  EXPECT_EQ(l.Remaining(a).count(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  l.Grant(SequenceKey("", "b"), 60000);  // grants sweep the expired ones (at most every second)
  EXPECT_EQ(l.size(), 1);
}

TEST(StandbyLeases, APromotionWaitsForTheLeaseAndThenRefusesEveryGrant) {
  StandbyLeases l;
  const SequenceKey a("t", "a"), b("t", "b");
  EXPECT_TRUE(l.Grant(a, 5000));
  const auto left = l.BeginPromotion(a, /*release=*/false);
  EXPECT_GT(left.count(), 4000) << "a running lease holds the promotion back";
  EXPECT_TRUE(l.Grant(a, 5000)) << "and nothing changed: its primary still renews";
  EXPECT_EQ(l.BeginPromotion(a, /*release=*/true).count(), 0) << "its primary let it go";
  EXPECT_FALSE(l.Grant(a, 5000)) << "no renewal while it is promoted";
  EXPECT_FALSE(l.Grant(a, 0)) << "nor a replication step without a lease";
  l.EndPromotion(a);
  EXPECT_TRUE(l.Grant(a, 0));
  EXPECT_EQ(l.BeginPromotion(b, /*release=*/false).count(), 0) << "never leased: promote";
  EXPECT_FALSE(l.Grant(b, 100));
  l.EndPromotion(b);
  EXPECT_TRUE(l.Grant(b, 100));
}

}  // namespace
}  // namespace attnd
