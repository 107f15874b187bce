// The sequence table: ids and limits, placement, page reference counts through fork, migrate,
// steps and close, and the rollback of every copy that fails.
#include "kv_store/sequence_table.h"

#include <gtest/gtest.h>

#include <numeric>

namespace attnd {
namespace {

constexpr int32_t kPageSize = 4;

SequenceTable Table(std::vector<int32_t> pages = {9, 9}) {
  std::vector<std::string> names;
  for (size_t i = 0; i < pages.size(); ++i) names.push_back("cpu:" + std::to_string(i));
  return SequenceTable(names, pages, kPageSize, SequenceLimits{8, 4});
}

// Grows `id` by `tokens` as a committed step would.
void Grow(SequenceTable& t, const std::string& id, int64_t tokens) {
  Sequence* s = t.Find(id);
  ASSERT_NE(s, nullptr);
  std::vector<int32_t> fresh;
  const int64_t n = s->length + tokens;
  ASSERT_LE(t.PagesToGrow(*s, n), t.pool(s->device).free_pages());
  t.Bind(s, 7, n, &fresh);
  EXPECT_EQ(s->step, 7u);
  t.Unbind(s, fresh, n, true);
}

int32_t Used(const SequenceTable& t, int d) { return t.pool(d).used_pages(); }

TEST(SequenceTable, ChecksIdsAndTheSequenceLimit) {
  SequenceTable t = Table();
  EXPECT_EQ(t.Open("", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Open("123456789", 0).code(), absl::StatusCode::kInvalidArgument);  // > 8 bytes
  ASSERT_TRUE(t.Open("a", 0).ok());
  EXPECT_EQ(t.Open("a", 1).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(t.Open("b", 2).code(), absl::StatusCode::kOutOfRange);
  for (const char* id : {"b", "c", "d"}) ASSERT_TRUE(t.Open(id, 0).ok());
  EXPECT_EQ(t.Open("e", 0).code(), absl::StatusCode::kResourceExhausted);  // limit 4
  EXPECT_EQ(t.size(), 4);
  EXPECT_EQ(t.sequences_on(0), 4);
}

TEST(SequenceTable, PlacesOnTheDeviceWithMostFreePagesTiesToTheLowest) {
  SequenceTable t = Table({9, 9, 9});
  ASSERT_TRUE(t.Open("a", -1).ok());
  EXPECT_EQ(t.Find("a")->device, 0);
  Grow(t, "a", 8);  // two pages on device 0
  ASSERT_TRUE(t.Open("b", -1).ok());
  EXPECT_EQ(t.Find("b")->device, 1);
  Grow(t, "b", 12);
  ASSERT_TRUE(t.Open("c", -1).ok());
  EXPECT_EQ(t.Find("c")->device, 2);
}

TEST(SequenceTable, AStepsPagesReturnOnAbortAndStayOnCommit) {
  SequenceTable t = Table();
  ASSERT_TRUE(t.Open("a", 0).ok());
  Sequence* s = t.Find("a");
  EXPECT_EQ(t.PagesToGrow(*s, 9), 3);
  std::vector<int32_t> fresh;
  t.Bind(s, 3, 9, &fresh);
  EXPECT_EQ(fresh.size(), 3u);
  EXPECT_EQ(Used(t, 0), 3);
  EXPECT_EQ(t.Close("a").code(), absl::StatusCode::kFailedPrecondition);  // in a step
  t.Unbind(s, fresh, 9, false);
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(s->length, 0);
  EXPECT_TRUE(s->pages.empty());
  EXPECT_EQ(s->step, 0u);
  Grow(t, "a", 9);
  EXPECT_EQ(s->length, 9);
  EXPECT_EQ(s->pages.size(), 3u);
  EXPECT_EQ(t.PagesToGrow(*s, 12), 0);  // the last page has room
  ASSERT_TRUE(t.Close("a").ok());
  EXPECT_EQ(Used(t, 0), 0);
}

TEST(SequenceTable, ForkOnTheSameDeviceSharesFullPagesAndCopiesThePartialOne) {
  SequenceTable t = Table();
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 10);  // pages: full, full, partial (2 rows)
  const std::vector<int32_t> parent = t.Find("p")->pages;
  PageMove move;
  ASSERT_TRUE(t.BeginFork("c", "p", 7, -1, &move).ok());
  const Sequence* c = t.Find("c");
  EXPECT_TRUE(c->copying);
  EXPECT_EQ(c->length, 7);
  ASSERT_EQ(c->pages.size(), 2u);
  EXPECT_EQ(c->pages[0], parent[0]);  // shared
  ASSERT_EQ(move.copies.size(), 1u);  // the partial page: 3 rows of the parent's second page
  EXPECT_EQ(move.copies[0].src, parent[1]);
  EXPECT_EQ(move.copies[0].dst, c->pages[1]);
  EXPECT_EQ(move.copies[0].rows, 3);
  EXPECT_EQ(t.pool(0).refcount(parent[0]), 2);
  EXPECT_EQ(t.pool(0).refcount(parent[1]), 2);  // pinned while copied
  // While it fills, the child can be neither closed, forked from, read nor migrated.
  EXPECT_TRUE(c->filling);
  EXPECT_EQ(t.Close("c").code(), absl::StatusCode::kFailedPrecondition);
  PageMove other;
  EXPECT_EQ(t.BeginFork("d", "c", 1, -1, &other).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.BeginMigrate("c", 1, &other).code(), absl::StatusCode::kFailedPrecondition);
  int device = -1;
  std::vector<int32_t> pinned;
  EXPECT_EQ(t.PinRows("c", 0, 1, &device, &pinned).code(), absl::StatusCode::kFailedPrecondition);
  t.EndFork("c", move, true);
  EXPECT_FALSE(t.Find("c")->copying);
  EXPECT_FALSE(t.Find("c")->filling);
  EXPECT_EQ(t.pool(0).refcount(parent[1]), 1);
  ASSERT_TRUE(t.Close("p").ok());
  EXPECT_EQ(t.pool(0).refcount(parent[0]), 1);  // still the child's
  ASSERT_TRUE(t.Close("c").ok());
  EXPECT_EQ(Used(t, 0), 0);
}

TEST(SequenceTable, AFailedCopyLeavesEverythingAsBefore) {
  SequenceTable t = Table();
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 10);
  const auto before0 = Used(t, 0), before1 = Used(t, 1);
  PageMove move;
  ASSERT_TRUE(t.BeginFork("c", "p", 10, 1, &move).ok());  // across devices: every page copied
  EXPECT_EQ(move.copies.size(), 3u);
  EXPECT_EQ(Used(t, 1), 3);
  t.EndFork("c", move, false);
  EXPECT_EQ(t.Find("c"), nullptr);
  EXPECT_EQ(Used(t, 0), before0);
  EXPECT_EQ(Used(t, 1), before1);
  for (int32_t p : t.Find("p")->pages) EXPECT_EQ(t.pool(0).refcount(p), 1);
  // A failed migration too.
  ASSERT_TRUE(t.BeginMigrate("p", 1, &move).ok());
  EXPECT_TRUE(t.Find("p")->copying);
  EXPECT_FALSE(t.Find("p")->filling);
  EXPECT_EQ(t.Close("p").code(), absl::StatusCode::kFailedPrecondition);
  // A migrating sequence stays readable and can be forked (from its old pages).
  PageMove child;
  ASSERT_TRUE(t.BeginFork("c", "p", 5, -1, &child).ok());
  EXPECT_EQ(t.Find("c")->device, 0);
  t.EndFork("c", child, true);
  int device = -1;
  std::vector<int32_t> pinned;
  ASSERT_TRUE(t.PinRows("p", 0, 10, &device, &pinned).ok());
  EXPECT_EQ(device, 0);
  t.Unpin(device, pinned);
  ASSERT_TRUE(t.Close("c").ok());
  t.EndMigrate("p", move, false);
  EXPECT_EQ(t.Find("p")->device, 0);
  EXPECT_FALSE(t.Find("p")->copying);
  EXPECT_EQ(Used(t, 1), 0);
  EXPECT_EQ(Used(t, 0), before0);
}

TEST(SequenceTable, MigrationMovesPagesAndCounts) {
  SequenceTable t = Table();
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 6);
  PageMove move;
  ASSERT_TRUE(t.BeginMigrate("p", 1, &move).ok());
  ASSERT_EQ(move.copies.size(), 2u);
  EXPECT_EQ(move.copies[1].rows, 2);
  t.EndMigrate("p", move, true);
  const Sequence* p = t.Find("p");
  EXPECT_EQ(p->device, 1);
  EXPECT_EQ(p->pages, move.fresh);
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(Used(t, 1), 2);
  EXPECT_EQ(t.sequences_on(0), 0);
  EXPECT_EQ(t.sequences_on(1), 1);
  // To where it is: nothing to copy.
  ASSERT_TRUE(t.BeginMigrate("p", 1, &move).ok());
  EXPECT_TRUE(move.copies.empty());
  EXPECT_FALSE(t.Find("p")->copying);
}

TEST(SequenceTable, AForkOrMigrationThatDoesNotFitChangesNothing) {
  SequenceTable t = Table({9, 3});  // device 1: 2 usable pages
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 12);
  PageMove move;
  EXPECT_EQ(t.BeginFork("c", "p", 12, 1, &move).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.Find("c"), nullptr);
  EXPECT_EQ(t.BeginMigrate("p", 1, &move).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Used(t, 1), 0);
  EXPECT_EQ(t.BeginFork("c", "p", 13, -1, &move).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.BeginFork("c", "nope", 1, -1, &move).code(), absl::StatusCode::kNotFound);
  for (int32_t p : t.Find("p")->pages) EXPECT_EQ(t.pool(0).refcount(p), 1);
}

TEST(SequenceTable, PinnedRowsOutliveAClose) {
  SequenceTable t = Table();
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 10);
  int device = -1;
  std::vector<int32_t> pages;
  EXPECT_EQ(t.PinRows("p", 3, 11, &device, &pages).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(t.PinRows("p", 3, 9, &device, &pages).ok());
  EXPECT_EQ(device, 0);
  ASSERT_EQ(pages.size(), 3u);  // rows 3..8 span pages 0, 1, 2
  ASSERT_TRUE(t.Close("p").ok());
  EXPECT_EQ(Used(t, 0), 3);  // pinned
  t.Unpin(device, pages);
  EXPECT_EQ(Used(t, 0), 0);
}

}  // namespace
}  // namespace attnd
