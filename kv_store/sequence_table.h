// The sequence table: every sequence's id, device, page list and length, the page pools their
// pages come from (reference counted: forks share full pages), placement, and the bookkeeping of
// page copies (fork across devices, migration) that run outside the caller's lock, and each
// tenant's share of them (quotas).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/block_hash.h"
#include "kv_store/eviction_policy.h"
#include "kv_store/page_directory.h"
#include "kv_store/page_pool.h"
#include "kv_store/page_table.h"
#include "kv_store/prefix_index.h"
#include "kv_store/slot_pool.h"
#include "kv_store/tenant_ledger.h"

namespace attnd {

// What is in flight on a sequence. Each begins and ends in the sequence table, one at a time.
enum class SequenceState : uint8_t {
  kIdle,
  kForking,    // a fork into it copies its pages: unreadable until done (EndFork)
  kMigrating,  // its pages are copied to another device: readable, no step (EndMigrate)
  kMoving,     // a tier move of it is in flight: no step, close, fork or read (EndTierMove)
  // A page of it could not be read back from the disk tier: it holds no pages any more, and
  // every use but close is DATA_LOSS. It stays so until closed.
  kLost,
};

struct Sequence {
  std::string tenant;
  std::string id;
  int device = 0;
  // Its pages in order: their ids in the page directory (kv_store/page_directory.h), which stay
  // the same wherever their bytes are, and their page ids on the device (the table steps read).
  std::vector<int32_t> logical;
  std::vector<int32_t> pages;
  int64_t length = 0;  // committed tokens
  uint64_t step = 0;   // the open step holding it, 0 if none
  // A handoff target: ordinary steps wait until write-only steps brought it to this length.
  int64_t import_length = 0;
  // Where it is (kv_store/page_directory.h): on the device every page of it is there and `pages`
  // holds their device ids; at the host or disk tier each page is there or faster and `pages`
  // is empty. A step, fork, migration or read needs it on the device.
  Tier tier = Tier::kDevice;
  // What is in flight on it (SequenceState), one thing at a time; `step` says which step holds
  // it (a step needs it idle and on the device).
  SequenceState state = SequenceState::kIdle;
  // The prefix cache (docs/prefix_cache.md): the hashes of its blocks known so far, in order
  // (from its prompt or from its steps' entries), and its prompt's token ids of those blocks
  // until they are committed (for KV events). A block is indexed when a step commits it.
  std::vector<BlockHash> hashes;
  std::vector<uint32_t> tokens;
  // Standby replicas (docs/replication.md): promotion increments the generation, and a step
  // naming another generation is refused (fencing). A standby copy takes only write-only steps
  // (its primary's commits) until it is promoted, and is charged to the standby budget, not to
  // its tenant.
  uint64_t generation = 1;
  bool standby = false;
  // When it was opened or a step last began or ended on it: its lease
  // (Engine::ExpireIdleSequences closes sequences idle for longer).
  std::chrono::steady_clock::time_point last_used = std::chrono::steady_clock::now();

  // Its pages are being copied (a fork into it, or its migration): no step, close or other
  // migration until the copy ends.
  bool copying() const {
    return state == SequenceState::kForking || state == SequenceState::kMigrating;
  }
  // A fork into it is filling its pages: nothing may read them yet (no fork from it, no export).
  // A migrating sequence stays readable: its old pages are valid until the move ends.
  bool filling() const { return state == SequenceState::kForking; }
  bool moving() const { return state == SequenceState::kMoving; }
  bool lost() const { return state == SequenceState::kLost; }
  // Neither in a step nor anything in flight: it may spill, move or be taken by a step.
  bool idle() const { return step == 0 && state == SequenceState::kIdle; }
};

// Generations stay below this (a promotion adds one; 0 means "not named" in a step).
inline constexpr uint64_t kMaxGeneration = uint64_t{1} << 62;

struct SequenceLimits {
  size_t max_id_bytes = 256;
  int64_t max_sequences = 65536;
};

// Pages the slower tiers hold (0: the tier is off): every device's sequences share them.
struct TierSlots {
  int32_t host = 0;
  int32_t disk = 0;
};

// The bytes to copy for a sequence to change tier (or, without a sequence, for pages no holder
// needs where they are to go down): between BeginTierMove and EndTierMove the pages are
// `moving`, their destinations reserved, their sources still theirs.
struct TierMove {
  SequenceKey key = SequenceKey("");  // empty id: pages only
  int device = 0;
  Tier from = Tier::kDevice, to = Tier::kDevice;  // the sequence's tiers
  struct Page {
    int32_t id = 0;  // directory id
    Tier from = Tier::kDevice;
    int32_t src = 0;
    Tier to = Tier::kDevice;
    int32_t dst = 0;
  };
  std::vector<Page> pages;
  // The sequence's other pages, pinned where they are until the move ends (move_pins).
  std::vector<int32_t> pinned;
};

// A page read where it is (SequenceTable::PinTierRows): its directory id, its tier and its slot
// there (on the device, the page id in the device's pool).
struct TierPin {
  int32_t id = 0;
  Tier tier = Tier::kDevice;
  int32_t slot = 0;
};

// Page copies to run between BeginFork/BeginMigrate and EndFork/EndMigrate: from device `from`
// to device `to` (the same for a fork's partial page). The source pages stay referenced (pinned)
// until the End call, so they outlive a concurrent close of their sequence.
struct PageMove {
  int from = 0;
  int to = 0;
  std::vector<PageCopy> copies;
  std::vector<int32_t> fresh;   // pages allocated on `to` for the copies, in sequence order
  std::vector<int32_t> pinned;  // the copies' sources (directory ids), held until the End call
};

// A change of the prefix cache, for KV events (docs/prefix_cache.md): blocks indexed (stored)
// or leaving the index (removed), in one tenant's cache on one device.
struct PrefixEvent {
  enum class Kind { kStored, kRemoved };
  Kind kind = Kind::kStored;
  std::string tenant;
  int device = 0;
  Tier tier = Tier::kDevice;  // where the first block's page is
  std::vector<BlockHash> hashes;
  bool has_parent = false;  // stored: the block before the first (absent for a prompt's first)
  BlockHash parent{};
  std::vector<uint32_t> tokens;  // stored: the blocks' token ids when known (else empty)
};

// The prefix cache's totals (metrics).
struct PrefixStats {
  int64_t lookups = 0;                      // opens that asked for cached blocks
  int64_t hit_blocks = 0, miss_blocks = 0;  // of the blocks they asked for
  int64_t hit_blocks_at[kNumTiers] = {};    // of the hits: the tier each page was on (by Tier)
  int64_t promoted_tokens = 0;  // tokens of standby copies promoted here (a failover kept them)
  int64_t stored_blocks = 0, removed_blocks = 0;
  int64_t blocks = 0;       // indexed now
  int64_t cached_only = 0;  // pages only the cache holds now (what retention costs)
};

// What LookupPrefix finds: the leading blocks of a hash list cached on one device (what an open
// would map) and where.
struct PrefixLookup {
  int64_t blocks = 0;
  int device = -1;
  int64_t on_device = 0;  // of those, pages on the device tier (the rest on the host or disk)
};

// Not thread safe: the owner (the engine) serialises every call under its lock.
class SequenceTable {
 public:
  // One pool per device (named for messages) of the given page count (page 0 included), pages
  // of page_size tokens.
  SequenceTable(std::vector<std::string> device_names, const std::vector<int32_t>& pages_per_device,
                int32_t page_size, SequenceLimits limits, TierSlots tiers = {});

  int num_devices() const { return static_cast<int>(pools_.size()); }
  // A device's pool: a page's reference count is its directory entry's holders while the page is
  // on the device.
  const PagePool& pool(int device) const { return pools_[device]; }
  const PageDirectory& directory() const { return dir_; }
  const SlotPool& host_slots() const { return host_; }
  const SlotPool& disk_slots() const { return disk_; }
  // Sequences at each tier, of every device.
  int64_t sequences_at(Tier tier) const { return at_tier_[static_cast<int>(tier)]; }
  int64_t sequences_on(int device) const { return counts_[device]; }
  // Device pages pinned by reads and copies now (PinRows, PinTierRows, a fork's or migration's
  // sources): what may let go of device pages soon.
  int64_t pins() const { return pins_; }
  int64_t size() const { return static_cast<int64_t>(seqs_.size()); }
  const TenantLedger& tenants() const { return tenants_; }
  TenantLedger& tenants() { return tenants_; }
  // The tiers' bookkeeping agrees with itself (for tests and the fuzzers; call it with no step
  // or move in flight): every page in exactly one tier and slot, its holders counted from the
  // sequences that hold it (pins for reads add device holders), a device page's pool count equal to
  // its holders, no page below the fastest tier a holder is at, each tier's used slots and sequence
  // count its entries', a sequence on its device reading its own pages there and one below holding
  // no device pages. INTERNAL naming the first disagreement.
  absl::Status CheckInvariants() const;
  // Every sequence, or with `tenant` set only that tenant's, in no particular order.
  std::vector<const Sequence*> List(const std::string* tenant) const;

  // nullptr when absent. Pointers stay valid until the sequence is closed.
  Sequence* Find(const SequenceKey& key);
  const Sequence* Find(const SequenceKey& key) const;
  // NOT_FOUND naming the sequence (never its tenant: another tenant's name reads as absent).
  absl::Status NotFound(const SequenceKey& key) const;
  // INVALID_ARGUMENT (empty, too long), ALREADY_EXISTS, RESOURCE_EXHAUSTED (table full, or the
  // tenant's sequence quota).
  absl::Status CheckNewId(const SequenceKey& key) const;
  // The device for a new sequence: most free pages, ties to the lowest index.
  int Place() const;
  // OUT_OF_RANGE unless device < num_devices() (a negative device means "any").
  absl::Status CheckDevice(int device) const;

  // Opens an empty sequence on `device` (< 0: Place()).
  absl::Status Open(const SequenceKey& key, int device);

  // Standby replicas (docs/replication.md). Opens an empty standby copy of `key` at
  // `generation` (placed as Open places it), charged to the standby budget: the tenant's quota
  // neither limits nor counts it.
  absl::Status OpenStandby(const SequenceKey& key, uint64_t generation);
  // Pages standby copies may hold (< 0: no limit) and what they hold.
  void SetStandbyBudget(int64_t pages) { standby_budget_ = pages; }
  int64_t standby_pages() const { return standby_pages_; }
  int64_t standby_sequences() const { return standby_seqs_; }
  int64_t standby_budget() const { return standby_budget_; }
  // RESOURCE_EXHAUSTED unless `pages` more fit the standby budget.
  absl::Status CheckStandbyPages(int64_t pages) const;
  // Makes the standby copy `key` at `generation` a sequence: cut back to `length` when it is
  // longer (rows its primary committed but no client saw confirmed), at generation + 1, charged
  // to its tenant from now on (beyond its quota if need be, as kept pages are). NOT_FOUND,
  // FAILED_PRECONDITION (not a standby at that generation; in a step, copying or moving; the
  // page it would keep writing into is shared), DATA_LOSS (lost).
  absl::Status Promote(const SequenceKey& key, uint64_t generation, int64_t length);

  // The prefix cache (docs/prefix_cache.md). `max_cached_pages`: pages only the cache may hold
  // (blocks of closed sequences), least recently used out first; < 0: as many as the tiers
  // hold (they leave when a request needs their room). `on_event` (may be empty) hears every
  // block indexed or removed, under the caller's lock.
  void SetPrefixCache(int64_t max_cached_pages, std::function<void(const PrefixEvent&)> on_event);
  // Opens `key` holding the longest run of `hashes` cached in its tenant's index, at most
  // `max_blocks`, on one device (`device`, or any with device < 0; a new sequence without cached
  // blocks is placed as Open places it). Cached pages are shared as a fork's full pages are;
  // pages below the device leave the sequence below it (a step restores it). The sequence keeps
  // `hashes` (and `tokens`, the token ids of their blocks or empty) for the blocks its steps
  // complete. At most what the tenant's page quota allows is taken. *cached_tokens: its length.
  absl::Status OpenCached(const SequenceKey& key, int device, std::vector<BlockHash> hashes,
                          std::vector<uint32_t> tokens, int64_t max_blocks, int64_t* cached_tokens);
  // The leading blocks of `hashes` an open of `tenant` would find (nothing touched).
  PrefixLookup LookupPrefix(const std::string& tenant, absl::Span<const BlockHash> hashes) const;
  // INVALID_ARGUMENT unless `completed` can be the hashes of the blocks a step taking `seq` to
  // new_len completes: one per block, after blocks whose hashes it knows, equal to those it
  // knows. Empty is always fine (the step indexes the hashes it knows).
  absl::Status CheckBlockHashes(const Sequence& seq, int64_t new_len,
                                absl::Span<const BlockHash> completed) const;
  PrefixStats prefix_stats() const {
    PrefixStats s = prefix_stats_;
    s.blocks = prefix_.size();
    s.cached_only = cache_only_;
    return s;
  }
  // Pages only the cache holds on `device`'s tier (free for any request that needs them).
  int32_t CachedOnly(Tier tier, int device) const;
  // Free slots of `tier` (pages of `device` for the device tier), counting the cache's own
  // pages there (at the cache's tier: they leave for a request that needs the room).
  int32_t Room(Tier tier, int device) const;
  // Makes `n` slots of `tier` free, removing the least recently used cached blocks there if
  // that tier is the cache's; false when it cannot.
  bool MakeFree(Tier tier, int device, int32_t n);
  // Removes least recently used blocks whose pages only the cache holds, at `tier` on `device`
  // (-1: any), until `need` pages are free; returns how many were.
  int32_t EvictCached(int tier, int device, int32_t need);
  // Empties every tenant's index (each block announced removed); returns how many blocks went.
  // Pages only the cache held are freed; sequences keep theirs.
  int64_t ClearPrefixCache();
  // FAILED_PRECONDITION while in a step or copying; releases its pages.
  absl::Status Close(const SequenceKey& key);

  // Creates `key` holding the first prefix_len tokens of `parent` (a sequence of the same tenant)
  // on `device` (< 0: the parent's). Every page of the child counts against its tenant's quota.
  // On the parent's device full pages are shared and the partial last page is copied; on another
  // device every page is copied. The child is `copying` and `filling` until EndFork. NOT_FOUND,
  // ALREADY_EXISTS, OUT_OF_RANGE, FAILED_PRECONDITION (parent filling), RESOURCE_EXHAUSTED; on
  // error nothing changed.
  absl::Status BeginFork(const SequenceKey& key, const std::string& parent, int64_t prefix_len,
                         int device, PageMove* move);
  // ok: the child becomes usable; otherwise it is removed and its pages released.
  void EndFork(const SequenceKey& key, const PageMove& move, bool ok);
  // Allocates pages for moving `key` to `device` and marks it copying; *move empty (no copy
  // needed) when it is already there. NOT_FOUND, OUT_OF_RANGE, FAILED_PRECONDITION (in a step,
  // copying), RESOURCE_EXHAUSTED.
  absl::Status BeginMigrate(const SequenceKey& key, int device, PageMove* move);
  // ok: the sequence now lives on move.to in the fresh pages; otherwise they are released.
  void EndMigrate(const SequenceKey& key, const PageMove& move, bool ok);

  // Steps. The new pages `seq` needs to hold new_len tokens.
  int32_t PagesToGrow(const Sequence& seq, int64_t new_len) const;
  // Binds `seq` to `step` and appends its new pages to *new_pages (charged to its tenant). The
  // caller checked with PagesToGrow that they are free and within the tenant's quota and reserved
  // *new_pages' capacity: this cannot fail.
  void Bind(Sequence* seq, uint64_t step, int64_t new_len, std::vector<int32_t>* new_pages);
  // Ends the step's hold: commit appends the new pages and sets the length; otherwise the
  // pages are released and the sequence is as before Bind.
  // `completed`: the hashes of the blocks the step completes (CheckBlockHashes), kept and
  // indexed on commit. `index` false (a context-parallel step: the sequence holds a slice, not
  // its blocks from the first): nothing is indexed and the sequence forgets its hashes.
  void Unbind(Sequence* seq, const std::vector<int32_t>& new_pages, int64_t new_len, bool commit,
              absl::Span<const BlockHash> completed = {}, bool index = true);

  // Checks that rows [begin, end) are committed rows of `key` and pins the pages holding them
  // (*pages, on *device) so they outlive a close while they are read. NOT_FOUND, OUT_OF_RANGE,
  // FAILED_PRECONDITION (filling).
  absl::Status PinRows(const SequenceKey& key, int64_t begin, int64_t end, int* device,
                       std::vector<int32_t>* pages);
  void Unpin(int device, const std::vector<int32_t>& pages);
  // PinRows for a sequence off the device: the pages holding rows [begin, end) where each is
  // (*pins, in order; of *device), kept there until UnpinTierRows: no move takes them and a
  // close frees them only then. NOT_FOUND, OUT_OF_RANGE, DATA_LOSS (lost), FAILED_PRECONDITION
  // (on the device, moving, or a page moving with another holder).
  absl::Status PinTierRows(const SequenceKey& key, int64_t begin, int64_t end, int* device,
                           std::vector<TierPin>* pins);
  void UnpinTierRows(const std::vector<TierPin>& pins);
  // Whether neither `key` nor any page it holds is moving or being read where it is: a move of
  // it can begin (an unknown sequence is settled).
  bool Settled(const SequenceKey& key) const;

  // Tiers. Plans moving `key` to tier `to`: to the device, every page not there comes up; down,
  // every page no other holder needs where it is goes to `to` (or to the fastest tier another
  // holder is at). Reserves the destinations and marks the sequence and its pages moving; *move
  // empty when nothing has to be copied. NOT_FOUND; DATA_LOSS (lost); FAILED_PRECONDITION (in a
  // step, copying, filling, moving, being imported); RESOURCE_EXHAUSTED naming the tier that
  // lacks room (nothing changed).
  absl::Status BeginTierMove(const SequenceKey& key, Tier to, TierMove* move);
  // DATA_LOSS for a lost sequence, FAILED_PRECONDITION unless it is on the device and not moving:
  // what a step, fork, migration or read of it needs.
  absl::Status OnDevice(const Sequence& seq) const;
  // The pages a move of `key` to `to` would copy into each tier (nothing reserved); zeros for an
  // unknown sequence or one already there.
  std::array<int32_t, kNumTiers> MoveNeeds(const SequenceKey& key, Tier to) const;
  // Pages of `device` (any device: -1) at `tier` that no holder needs there, to the tier they are
  // needed at, as many as fit (at most `max_pages`); *move empty when none.
  void BeginOrphanMove(Tier tier, int device, int32_t max_pages, TierMove* move);
  // ok: the pages live at their destinations (their sources freed) and the sequence at move.to;
  // otherwise everything is as before the Begin call. `lost`: directory ids whose bytes could not
  // be read: every sequence holding one is lost (DATA_LOSS from now on; its pages dropped).
  // Returns the sequences lost.
  std::vector<SequenceKey> EndTierMove(const TierMove& move, bool ok,
                                       const std::vector<int32_t>& lost = {});
  // The sequences at `tier` (on `device`; -1: any) that can move down (idle), in the eviction
  // policy's order, until moving them would free `need` slots of that tier; pages only they
  // hold there count. Empty when nothing can.
  std::vector<SequenceKey> Victims(Tier tier, int device, int32_t need,
                                   const std::vector<const Sequence*>& keep = {}) const;
  // Slots of `tier` (pages on `device`, -1: any) held only by holders at slower tiers.
  int32_t Orphans(Tier tier, int device) const;

  // Which sequences go first (LruEviction unless replaced).
  void SetEvictionPolicy(std::unique_ptr<const EvictionPolicy> policy) {
    eviction_ = std::move(policy);
  }
  const EvictionPolicy& eviction_policy() const { return *eviction_; }

 private:
  // Appends the copies of the first `length` tokens of `pages` into fresh pages of `to`, or
  // returns false (nothing allocated) when `to` lacks pages.
  bool PlanCopy(const std::vector<int32_t>& pages, int64_t length, int to, PageMove* move);
  // Holds the copies' sources for the copy (move->pinned).
  void Pin(PageMove* move);
  void Unpin(const PageMove& move);
  // Charges `pages` (negative: gives back) to the sequence's tenant, or to the standby budget
  // for a standby copy; ChargeSequences the same for sequence counts.
  void Charge(const Sequence& seq, int64_t pages);
  void ChargeSequences(const Sequence& seq, int64_t n);
  // Adds a new sequence (its tier's and device's counts, its tenant's share of sequences and of
  // the pages it holds already); Erase undoes it.
  void Insert(std::unique_ptr<Sequence> seq);
  // Removes a sequence, releasing its pages and its tenant's share.
  void Erase(Sequence* seq);
  // A directory entry for device page `page` of `device` (one holder on the device).
  int32_t NewPage(int device, int32_t page);
  // Reserves a destination for a page at `tier` (of `device` for the device tier).
  bool Reserve(Tier tier, int device, int32_t* slot);
  // Frees a slot of `tier` that no entry occupies (a reservation, or a page's old place).
  void FreeSlot(Tier tier, int device, int32_t slot);
  // Marks every sequence holding one of `ids` lost; returns them.
  std::vector<SequenceKey> LoseHolders(const std::vector<int32_t>& ids);
  // One more or one fewer holder at `holder` (a device page's pool count follows); a page
  // without holders leaves the directory and its pool.
  void Hold(int32_t id, Tier holder);
  void Drop(int32_t id, Tier holder);
  // `key` when rows [begin, end) are committed rows of it: NOT_FOUND, OUT_OF_RANGE.
  absl::StatusOr<const Sequence*> WithRows(const SequenceKey& key, int64_t begin,
                                           int64_t end) const;
  // Removes a page no holder, move or read has left (its slot freed).
  void RemoveIfUnheld(int32_t id);
  // The prefix cache's hold of a page (at cache_tier_).
  void CacheHold(int32_t id);
  void CacheDrop(int32_t id);
  static bool CacheOnly(const PageDirectory::Entry& e) { return e.cached && e.refs() == 1; }
  int32_t FreeSlots(Tier tier, int device) const;
  // KV events for the indexed pages a tier move took (page id, the tier it left): each block
  // removed where it was and stored where it is now.
  void AnnounceTierMoves(const std::vector<std::pair<int32_t, Tier>>& moved);
  // Indexes the blocks of `seq` committed since old_len whose hashes it knows (and any earlier
  // one that left the index meanwhile, so that the chain stays whole).
  void IndexBlocks(Sequence* seq, int64_t old_len);
  // Removes a block and the blocks after it; returns the pages that became free at `tier` on
  // `device` (-1: any).
  int32_t RemoveBlock(int32_t block, int tier, int device);
  // Within max_cached_: removes the least recently used cache-only blocks beyond it.
  void TrimCache();

  std::vector<std::string> names_;
  std::unique_ptr<const EvictionPolicy> eviction_ = std::make_unique<LruEviction>();
  std::vector<PagePool> pools_;
  PageDirectory dir_;
  std::vector<std::vector<int32_t>> owner_;  // [device][page]: its directory id, -1 if free
  int64_t at_tier_[kNumTiers] = {0, 0, 0};
  int64_t pins_ = 0;
  std::vector<int64_t> counts_;  // sequences per device
  SequenceLimits limits_;
  int32_t page_size_ = 0;
  SlotPool host_, disk_;
  absl::flat_hash_map<SequenceKey, std::unique_ptr<Sequence>> seqs_;
  TenantLedger tenants_;
  PrefixIndex prefix_;
  Tier cache_tier_ = Tier::kDevice;  // the slowest tier on
  int64_t max_cached_ = -1;
  int64_t cache_only_ = 0;
  int64_t standby_budget_ = -1, standby_pages_ = 0, standby_seqs_ = 0;
  PrefixStats prefix_stats_;
  std::function<void(const PrefixEvent&)> on_prefix_event_;
};

}  // namespace attnd
