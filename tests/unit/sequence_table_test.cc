// The sequence table: ids and limits, placement, page reference counts through fork, migrate,
// steps and close, and the rollback of every copy that fails.
#include "kv_store/sequence_table.h"

#include <gtest/gtest.h>

#include <numeric>

namespace attnd {
namespace {

constexpr int32_t kPageSize = 4;

SequenceTable Table(std::vector<int32_t> pages = {9, 9}, TierSlots tiers = {}) {
  std::vector<std::string> names;
  for (size_t i = 0; i < pages.size(); ++i) names.push_back("cpu:" + std::to_string(i));
  return SequenceTable(names, pages, kPageSize, SequenceLimits{8, 4}, tiers);
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
  EXPECT_TRUE(c->copying());
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
  EXPECT_TRUE(c->filling());
  EXPECT_EQ(t.Close("c").code(), absl::StatusCode::kFailedPrecondition);
  PageMove other;
  EXPECT_EQ(t.BeginFork("d", "c", 1, -1, &other).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.BeginMigrate("c", 1, &other).code(), absl::StatusCode::kFailedPrecondition);
  int device = -1;
  std::vector<int32_t> pinned;
  EXPECT_EQ(t.PinRows("c", 0, 1, &device, &pinned).code(), absl::StatusCode::kFailedPrecondition);
  t.EndFork("c", move, true);
  EXPECT_FALSE(t.Find("c")->copying());
  EXPECT_FALSE(t.Find("c")->filling());
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
  EXPECT_TRUE(t.Find("p")->copying());
  EXPECT_FALSE(t.Find("p")->filling());
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
  EXPECT_FALSE(t.Find("p")->copying());
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
  EXPECT_FALSE(t.Find("p")->copying());
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

// Every page is in exactly one tier: a device page's pool count is its entry's holders and the
// owner map points back at it; host and disk slots in use are exactly the entries there; each
// sequence's holds are counted at its tier; sequences on the device hold their device pages.
void Audit(const SequenceTable& t) {
  const absl::Status invariants = t.CheckInvariants();
  EXPECT_TRUE(invariants.ok()) << invariants;
  std::vector<int32_t> holders_by_tier_sum(3, 0);
  int32_t host = 0, disk = 0;
  std::vector<int32_t> device_pages(t.num_devices(), 0);
  t.directory().ForEach([&](int32_t id, const PageDirectory::Entry& e) {
    ASSERT_GT(e.refs(), 0) << id;
    ASSERT_FALSE(e.moving) << id;
    if (e.tier == Tier::kDevice) {
      EXPECT_EQ(t.pool(e.device).refcount(e.slot), e.refs()) << "page " << id;
      ++device_pages[e.device];
    }
    if (e.tier == Tier::kHost) {
      EXPECT_TRUE(t.host_slots().used(e.slot));
      ++host;
    }
    if (e.tier == Tier::kDisk) {
      EXPECT_TRUE(t.disk_slots().used(e.slot));
      ++disk;
    }
    // A page lives at or faster than the fastest tier a holder is at.
    EXPECT_LE(static_cast<int>(e.tier), static_cast<int>(e.needed())) << id;
  });
  for (int d = 0; d < t.num_devices(); ++d) EXPECT_EQ(t.pool(d).used_pages(), device_pages[d]);
  EXPECT_EQ(t.host_slots().used_slots(), host);
  EXPECT_EQ(t.disk_slots().used_slots(), disk);
  for (const Sequence* s : t.List(nullptr)) {
    if (s->tier == Tier::kDevice) {
      ASSERT_EQ(s->pages.size(), s->logical.size()) << s->id;
      for (size_t i = 0; i < s->pages.size(); ++i) {
        EXPECT_EQ(t.directory().at(s->logical[i]).tier, Tier::kDevice) << s->id;
        EXPECT_EQ(t.directory().at(s->logical[i]).slot, s->pages[i]) << s->id;
      }
    } else {
      EXPECT_TRUE(s->pages.empty()) << s->id;
    }
  }
}

// Moves `id` to `to` as the engine does (the bytes copied in between) and checks the result.
void MoveTo(SequenceTable& t, const std::string& id, Tier to, TierMove* move = nullptr) {
  TierMove m;
  ASSERT_TRUE(t.BeginTierMove(id, to, &m).ok());
  EXPECT_TRUE(t.Find(id)->moving() || m.pages.empty());
  t.EndTierMove(m, true);
  EXPECT_EQ(t.Find(id)->tier, to);
  EXPECT_FALSE(t.Find(id)->moving());
  if (move) *move = m;
  Audit(t);
}

TEST(SequenceTableTiers, ASpilledSequenceGivesItsDevicePagesBackAndComesBackWhole) {
  SequenceTable t = Table({9, 9}, {6, 6});
  ASSERT_TRUE(t.Open("a", 0).ok());
  Grow(t, "a", 10);  // 3 pages
  TierMove m;
  MoveTo(t, "a", Tier::kHost, &m);
  ASSERT_EQ(m.pages.size(), 3u);
  for (const TierMove::Page& p : m.pages) {
    EXPECT_EQ(p.from, Tier::kDevice);
    EXPECT_EQ(p.to, Tier::kHost);
  }
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(t.host_slots().used_slots(), 3);
  EXPECT_EQ(t.sequences_at(Tier::kHost), 1);
  EXPECT_EQ(t.PagesToGrow(*t.Find("a"), 12), 0);  // its length and pages are its own still
  // Not usable until back: forks, migrations and reads say so.
  PageMove pm;
  EXPECT_EQ(t.BeginFork("c", "a", 4, -1, &pm).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.BeginMigrate("a", 1, &pm).code(), absl::StatusCode::kFailedPrecondition);
  MoveTo(t, "a", Tier::kDisk, &m);  // host -> disk
  EXPECT_EQ(t.host_slots().used_slots(), 0);
  EXPECT_EQ(t.disk_slots().used_slots(), 3);
  MoveTo(t, "a", Tier::kDevice, &m);  // disk -> device
  ASSERT_EQ(m.pages.size(), 3u);
  EXPECT_EQ(m.pages[0].from, Tier::kDisk);
  EXPECT_EQ(Used(t, 0), 3);
  EXPECT_EQ(t.Find("a")->pages.size(), 3u);
  EXPECT_EQ(t.disk_slots().used_slots(), 0);
  ASSERT_TRUE(t.Close("a").ok());
  Audit(t);
  EXPECT_EQ(t.directory().size(), 0);
}

// p of 10 tokens on device 0 (full, full, partial pages) and c, its fork at 9: the two full
// pages shared, the partial one copied.
void ParentAndFork(SequenceTable& t) {
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 10);
  PageMove fork;
  ASSERT_TRUE(t.BeginFork("c", "p", 9, -1, &fork).ok());
  t.EndFork("c", fork, true);
}

TEST(SequenceTableTiers, SharedPagesMoveOnceWhenTheirLastHolderOnTheDeviceLeaves) {
  SequenceTable t = Table({12, 9}, {8, 8});
  ParentAndFork(t);
  TierMove m;
  MoveTo(t, "c", Tier::kHost, &m);  // p still on the device: only c's own page moves
  EXPECT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(t.pool(0).refcount(t.Find("p")->pages[0]), 2);  // shared, held from two tiers
  MoveTo(t, "p", Tier::kHost, &m);  // now the shared pages go too, once each
  EXPECT_EQ(m.pages.size(), 3u);    // 2 shared + p's partial page
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(t.host_slots().used_slots(), 4);
  MoveTo(t, "c", Tier::kDevice, &m);  // c back: the shared pages come up for c
  EXPECT_EQ(m.pages.size(), 3u);
  EXPECT_EQ(t.host_slots().used_slots(), 1);  // p's partial page only
  MoveTo(t, "p", Tier::kDevice, &m);          // the shared pages are there already
  EXPECT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(t.Find("p")->pages[0], t.Find("c")->pages[0]);
  EXPECT_EQ(t.pool(0).refcount(t.Find("p")->pages[0]), 2);
  ASSERT_TRUE(t.Close("p").ok());
  ASSERT_TRUE(t.Close("c").ok());
  Audit(t);
  EXPECT_EQ(Used(t, 0), 0);
}

// An export reads a spilled sequence where its pages are (PinTierRows): the pages on the host
// neither move nor leave while read, those shared with a sequence on the device stay there,
// and a close during the read frees its pages when the read ends.
TEST(SequenceTableTiers, PagesReadWhereTheyAreNeitherMoveNorLeaveUntilTheReadEnds) {
  SequenceTable t = Table({12, 9}, {8, 8});
  ParentAndFork(t);
  MoveTo(t, "c", Tier::kHost);  // its own page to the host; the shared ones stay with p
  int device = -1;
  std::vector<TierPin> pins;
  EXPECT_EQ(t.PinTierRows("p", 0, 4, &device, &pins).code(), absl::StatusCode::kFailedPrecondition)
      << "on the device: PinRows reads it";
  EXPECT_EQ(t.PinTierRows("c", 2, 10, &device, &pins).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.PinTierRows("nobody", 0, 1, &device, &pins).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(t.PinTierRows("c", 2, 9, &device, &pins).ok());
  EXPECT_EQ(device, 0);
  ASSERT_EQ(pins.size(), 3u);  // rows 2..8 span its 3 pages
  EXPECT_EQ(pins[0].tier, Tier::kDevice);
  EXPECT_EQ(pins[0].slot, t.Find("p")->pages[0]);
  EXPECT_EQ(pins[1].tier, Tier::kDevice);
  EXPECT_EQ(pins[2].tier, Tier::kHost);
  EXPECT_EQ(pins[2].slot, t.directory().at(t.Find("c")->logical[2]).slot);
  EXPECT_EQ(t.pins(), 2);  // the device pages (what may free device room)
  EXPECT_FALSE(t.Settled("c"));
  EXPECT_TRUE(t.Settled("p"));
  TierMove m;
  EXPECT_EQ(t.BeginTierMove("c", Tier::kDevice, &m).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.BeginTierMove("c", Tier::kDisk, &m).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(t.Find("c")->moving());
  EXPECT_EQ(t.host_slots().used_slots(), 1);
  // p goes down; the shared pages, held on the device by the read, stay there.
  ASSERT_TRUE(t.BeginTierMove("p", Tier::kHost, &m).ok());
  EXPECT_EQ(m.pages.size(), 1u);
  t.EndTierMove(m, true);
  EXPECT_EQ(Used(t, 0), 2);
  EXPECT_EQ(t.Orphans(Tier::kDevice, 0), 0);  // the read holds them there
  // Room on the host counts no page being read: c is no victim, nor d, one of whose pages is
  // read (it could not move: making room would stop at it).
  ASSERT_TRUE(t.Open("d", 0).ok());
  Grow(t, "d", 8);  // 2 pages of its own
  MoveTo(t, "d", Tier::kHost);
  std::vector<TierPin> d_pins;
  ASSERT_TRUE(t.PinTierRows("d", 0, 3, &device, &d_pins).ok());
  ASSERT_EQ(d_pins.size(), 1u);
  const std::vector<SequenceKey> victims = t.Victims(Tier::kHost, -1, 8);
  ASSERT_EQ(victims.size(), 1u);
  EXPECT_EQ(victims[0].id, "p");
  t.UnpinTierRows(d_pins);
  EXPECT_EQ(t.Victims(Tier::kHost, -1, 8).size(), 2u);
  ASSERT_TRUE(t.Close("d").ok());
  ASSERT_TRUE(t.Close("c").ok());
  EXPECT_TRUE(t.host_slots().used(pins[2].slot));  // outlives the close while read
  EXPECT_EQ(t.host_slots().used_slots(), 2);       // p's partial page and c's
  t.UnpinTierRows(pins);
  EXPECT_EQ(t.pins(), 0);
  EXPECT_EQ(t.host_slots().used_slots(), 1);  // c's page went with its read
  EXPECT_EQ(Used(t, 0), 2);                   // orphans now: only p, on the host, holds them
  EXPECT_EQ(t.Orphans(Tier::kDevice, 0), 2);
  Audit(t);
  ASSERT_TRUE(t.Close("p").ok());
  Audit(t);
  EXPECT_EQ(t.directory().size(), 0);
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(t.host_slots().used_slots(), 0);
}

TEST(SequenceTableTiers, AMoveThatFailsOrDoesNotFitChangesNothing) {
  SequenceTable t = Table({9, 9}, {2, 4});
  ASSERT_TRUE(t.Open("a", 0).ok());
  Grow(t, "a", 12);  // 3 pages; the host tier holds 2
  TierMove m;
  const absl::Status full = t.BeginTierMove("a", Tier::kHost, &m);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("host tier full"), std::string::npos) << full;
  EXPECT_EQ(t.Find("a")->tier, Tier::kDevice);
  EXPECT_FALSE(t.Find("a")->moving());
  Audit(t);
  ASSERT_TRUE(t.BeginTierMove("a", Tier::kDisk, &m).ok());
  EXPECT_EQ(t.disk_slots().used_slots(), 3);                              // reserved
  EXPECT_EQ(t.Close("a").code(), absl::StatusCode::kFailedPrecondition);  // moving
  TierMove again;
  EXPECT_EQ(t.BeginTierMove("a", Tier::kHost, &again).code(),
            absl::StatusCode::kFailedPrecondition);
  t.EndTierMove(m, false);  // a write failed: everything as before
  EXPECT_EQ(t.Find("a")->tier, Tier::kDevice);
  EXPECT_EQ(t.Find("a")->pages.size(), 3u);
  EXPECT_EQ(t.disk_slots().used_slots(), 0);
  EXPECT_EQ(Used(t, 0), 3);
  Audit(t);
  // A tier that is off.
  SequenceTable none = Table();
  ASSERT_TRUE(none.Open("a", 0).ok());
  EXPECT_EQ(none.BeginTierMove("a", Tier::kHost, &m).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SequenceTableTiers, APageLostOnTheDiskLosesEverySequenceHoldingItAndNothingElse) {
  SequenceTable t = Table({12, 9}, {0, 8});
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 8);  // 2 full pages
  PageMove fork;
  ASSERT_TRUE(t.BeginFork("c", "p", 8, -1, &fork).ok());
  t.EndFork("c", fork, true);
  ASSERT_TRUE(t.Open("x", 0).ok());
  Grow(t, "x", 4);
  MoveTo(t, "c", Tier::kDisk);
  MoveTo(t, "p", Tier::kDisk);
  MoveTo(t, "x", Tier::kDisk);
  TierMove m;
  ASSERT_TRUE(t.BeginTierMove("c", Tier::kDevice, &m).ok());
  ASSERT_EQ(m.pages.size(), 2u);
  // The first page's checksum failed: c and p (which shares it) are lost, x is not.
  const std::vector<SequenceKey> lost = t.EndTierMove(m, false, {m.pages[0].id});
  EXPECT_EQ(lost.size(), 2u);
  for (const char* id : {"c", "p"}) {
    const Sequence* s = t.Find(id);
    ASSERT_NE(s, nullptr);
    EXPECT_TRUE(s->lost());
    EXPECT_TRUE(s->logical.empty());
    TierMove none;
    EXPECT_EQ(t.BeginTierMove(id, Tier::kDevice, &none).code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_FALSE(t.Find("x")->lost());
  EXPECT_EQ(t.disk_slots().used_slots(), 1);  // x's page only
  EXPECT_EQ(t.tenants().UsageOf("").pages, 1);
  Audit(t);
  MoveTo(t, "x", Tier::kDevice);
  ASSERT_TRUE(t.Close("c").ok());
  ASSERT_TRUE(t.Close("p").ok());
  Audit(t);
}

TEST(SequenceTableTiers, PagesNoHolderNeedsOnTheDeviceAreOrphansThatGoDown) {
  SequenceTable t = Table({12, 9}, {8, 0});
  ASSERT_TRUE(t.Open("p", 0).ok());
  Grow(t, "p", 8);
  PageMove fork;
  ASSERT_TRUE(t.BeginFork("c", "p", 8, -1, &fork).ok());
  t.EndFork("c", fork, true);
  MoveTo(t, "c", Tier::kHost);  // shares both pages with p: nothing moves
  EXPECT_EQ(t.host_slots().used_slots(), 0);
  ASSERT_TRUE(t.Close("p").ok());  // the pages stay on the device, needed only at the host
  EXPECT_EQ(t.Orphans(Tier::kDevice, 0), 2);
  EXPECT_EQ(Used(t, 0), 2);
  TierMove m;
  t.BeginOrphanMove(Tier::kDevice, 0, 8, &m);
  ASSERT_EQ(m.pages.size(), 2u);
  t.EndTierMove(m, true);
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(t.host_slots().used_slots(), 2);
  EXPECT_EQ(t.Orphans(Tier::kDevice, 0), 0);
  Audit(t);
}

// The eviction policy is the table's to replace: one that takes the most recently used first
// reverses the order, and still never names a sequence that cannot move.
TEST(SequenceTableTiers, AnotherEvictionPolicyChoosesOtherVictims) {
  class MostRecentFirst final : public EvictionPolicy {
   public:
    std::string_view name() const override { return "mru"; }
    void Rank(std::vector<const Sequence*>& c) const override {
      LruEviction().Rank(c);
      std::reverse(c.begin(), c.end());
    }
  };
  SequenceTable t = Table({20, 9}, {8, 8});
  for (const char* id : {"a", "b", "c", "d"}) {
    ASSERT_TRUE(t.Open(id, 0).ok());
    Grow(t, id, 8);  // 2 pages each; used in this order
  }
  t.Find("c")->step = 99;  // in a step: never a victim
  EXPECT_EQ(t.eviction_policy().name(), "lru");
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 3), (std::vector<SequenceKey>{"a", "b"}));
  t.SetEvictionPolicy(std::make_unique<MostRecentFirst>());
  EXPECT_EQ(t.eviction_policy().name(), "mru");
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 3), (std::vector<SequenceKey>{"d", "b"}));
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 100), (std::vector<SequenceKey>{"d", "b", "a"}));
  t.Find("c")->step = 0;
  Audit(t);
}

TEST(SequenceTableTiers, VictimsAreTheLeastRecentlyUsedThatCanMove) {
  SequenceTable t = Table({20, 9}, {8, 8});
  for (const char* id : {"a", "b", "c", "d"}) {
    ASSERT_TRUE(t.Open(id, 0).ok());
    Grow(t, id, 8);  // 2 pages each; used in this order
  }
  t.Find("b")->step = 99;  // in a step: never a victim
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 3), (std::vector<SequenceKey>{"a", "c"}));
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 100).size(), 3u);
  EXPECT_TRUE(t.Victims(Tier::kDevice, 1, 1).empty());  // nothing on device 1
  t.Find("b")->step = 0;
  // A pinned page stays (its holders on the device are two): a pinned sequence frees less.
  int device = -1;
  std::vector<int32_t> pinned;
  ASSERT_TRUE(t.PinRows("a", 0, 8, &device, &pinned).ok());
  EXPECT_EQ(t.Victims(Tier::kDevice, 0, 2), (std::vector<SequenceKey>{"b"}));
  TierMove m;
  MoveTo(t, "a", Tier::kHost, &m);
  EXPECT_TRUE(m.pages.empty());  // both pages pinned on the device
  t.Unpin(device, pinned);
  EXPECT_EQ(t.Orphans(Tier::kDevice, 0), 2);
}

// A sequence opened with the prompt blocks `hashes` on `device`, its blocks committed (indexed)
// and closed: its pages stay, held by the prefix cache only.
void CachedAndClosed(SequenceTable& t, const std::string& id, int device,
                     std::vector<BlockHash> hashes) {
  const int64_t n = static_cast<int64_t>(hashes.size());
  int64_t cached = -1;
  ASSERT_TRUE(t.OpenCached(id, device, hashes, {}, n, &cached).ok());
  ASSERT_EQ(cached, 0);
  Grow(t, id, n * kPageSize);
  ASSERT_TRUE(t.Close(id).ok());
  ASSERT_EQ(t.LookupPrefix("", hashes).blocks, n);
}

BlockHash Hash(uint8_t v) {
  BlockHash h{};
  h[0] = v;
  h[31] = 0x5a;
  return h;
}

// Host and disk slots serve every device: a sequence of device 0 spilling to a disk full of
// device 1's cached blocks takes a slot one of them gives back (it was given slot 0, still
// another page's: two pages on one slot, and a prefix hit returning the other's rows).
TEST(SequenceTableTiers, ASpillTakesRoomCachedBlocksOfAnotherDeviceGiveBack) {
  SequenceTable t = Table({9, 9}, {0, 1});
  t.SetPrefixCache(-1, {});
  CachedAndClosed(t, "x", 1, {Hash(1)});
  TierMove o;
  t.BeginOrphanMove(Tier::kDevice, 1, 1, &o);  // x's page goes to the cache's tier, the disk
  ASSERT_EQ(o.pages.size(), 1u);
  t.EndTierMove(o, true);
  EXPECT_EQ(t.disk_slots().used_slots(), 1);
  ASSERT_TRUE(t.Open("y", 0).ok());
  Grow(t, "y", kPageSize);
  TierMove m;
  ASSERT_TRUE(t.BeginTierMove("y", Tier::kDisk, &m).ok());
  ASSERT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(t.LookupPrefix("", std::vector<BlockHash>{Hash(1)}).blocks, 0) << "evicted";
  t.EndTierMove(m, true);
  EXPECT_EQ(t.disk_slots().used_slots(), 1);
  Audit(t);
  MoveTo(t, "y", Tier::kDevice);
  ASSERT_TRUE(t.Close("y").ok());
  Audit(t);
}

// An orphan page whose room on the disk is made by evicting its own parent block (removing
// the chain, and so the page itself) is left alone, and the slot is given back.
TEST(SequenceTableTiers, AnOrphanWhoseRoomEvictsItsOwnChainStaysAlone) {
  SequenceTable t = Table({9, 9}, {0, 1});
  t.SetPrefixCache(-1, {});
  CachedAndClosed(t, "x", 0, {Hash(1), Hash(2)});  // blocks A -> B
  TierMove m;
  t.BeginOrphanMove(Tier::kDevice, 0, 1, &m);  // A to the disk, which is then full
  ASSERT_EQ(m.pages.size(), 1u);
  t.EndTierMove(m, true);
  EXPECT_EQ(Used(t, 0), 1);
  t.BeginOrphanMove(Tier::kDevice, 0, 1, &m);  // B: room by evicting A, and with it B
  EXPECT_TRUE(m.pages.empty());
  t.EndTierMove(m, true);
  EXPECT_EQ(Used(t, 0), 0);
  EXPECT_EQ(t.disk_slots().used_slots(), 0);
  EXPECT_EQ(t.directory().size(), 0);
  EXPECT_EQ(t.LookupPrefix("", std::vector<BlockHash>{Hash(1), Hash(2)}).blocks, 0);
  Audit(t);
}

// While a sequence moves between tiers, the pages it shares and leaves where they are stay
// there: a failed move takes its holds back to them. (Another sequence's move carried them to
// the host meanwhile, and the failed one came back "on the device" with host slot numbers.)
TEST(SequenceTableTiers, PagesAMovingSequenceSharesStayUntilItsMoveEnds) {
  SequenceTable t = Table({12, 9}, {8, 8});
  ParentAndFork(t);
  TierMove mc, mp;
  ASSERT_TRUE(t.BeginTierMove("c", Tier::kHost, &mc).ok());
  EXPECT_EQ(mc.pages.size(), 1u);  // its own partial page; the 2 shared ones pinned
  EXPECT_EQ(mc.pinned.size(), 2u);
  EXPECT_FALSE(t.Settled("p"));
  const absl::Status busy = t.BeginTierMove("p", Tier::kHost, &mp);
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_TRUE(t.Victims(Tier::kDevice, 0, 8).empty()) << "p cannot move now";
  t.EndTierMove(mc, false);  // c's copy failed: c is on the device again, whole
  EXPECT_EQ(t.Find("c")->tier, Tier::kDevice);
  Audit(t);
  EXPECT_TRUE(t.Settled("p"));
  MoveTo(t, "p", Tier::kHost);  // now p moves: its partial page only (c holds the shared ones)
  MoveTo(t, "c", Tier::kHost);
  EXPECT_EQ(Used(t, 0), 0);
  MoveTo(t, "c", Tier::kDevice);
  ASSERT_TRUE(t.Close("p").ok());
  ASSERT_TRUE(t.Close("c").ok());
  Audit(t);
  EXPECT_EQ(t.directory().size(), 0);
}

}  // namespace
}  // namespace attnd
