// Where every cached page is, across the tiers of docs/architecture.md's KV store: each page has
// a directory id that stays the same while its bytes move between a device's page pool, the host
// tier and the disk tier, so a page that several sequences share (a fork's full pages) moves
// once and stays shared. Each page counts its holders by the holder's tier: a page lives in the
// fastest tier any holder is at (a sequence on the device needs every page of its on the device;
// a spilled sequence's page stays on the device while a sequence on the device shares it).
// Not thread safe: the sequence table calls it under the engine's lock.
#pragma once

#include <cstdint>
#include <vector>

namespace attnd {

// The tiers, fastest first.
enum class Tier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };
inline constexpr int kNumTiers = 3;
const char* TierName(Tier tier);  // "device", "host", "disk"

class PageDirectory {
 public:
  struct Entry {
    int device = 0;  // the device whose sequences hold it
    Tier tier = Tier::kDevice;
    int32_t slot = 0;  // page id in the device's pool, or the slot in the host or disk tier
    // Holders by the tier each is at (sequences; a pin counts as one on the device).
    int32_t holders[kNumTiers] = {0, 0, 0};
    bool moving = false;  // its bytes are being copied to another tier
    // Reads of its bytes where they are, on the host or disk tier (SequenceTable::PinTierRows):
    // it neither moves nor leaves the directory until they end.
    int32_t reads = 0;
    // Sequences moving between tiers that hold it and leave it where it is (their holds count
    // at the move's tier; a failed move takes them back, so the page must still be here).
    int32_t move_pins = 0;
    bool live = false;
    // A prefix-cache block (kv_store/prefix_index.h) names it: the cache is one of its holders,
    // counted at the slowest tier on, so a page only the cache holds goes down the tiers first.
    bool cached = false;
    int32_t refs() const { return holders[0] + holders[1] + holders[2]; }
    // Moving, read where it is, or pinned by a holder's move: its place may not change.
    bool busy() const { return moving || reads > 0 || move_pins > 0; }
    // The tier it must be in: the fastest any holder is at.
    Tier needed() const {
      return holders[0] > 0 ? Tier::kDevice : holders[1] > 0 ? Tier::kHost : Tier::kDisk;
    }
  };

  // A new page with one holder at `holder`; returns its id.
  int32_t Add(int device, Tier tier, int32_t slot, Tier holder);
  // Drops a page (it has no holders left); its id may be reused.
  void Remove(int32_t id);
  Entry& at(int32_t id) { return entries_[id]; }
  const Entry& at(int32_t id) const { return entries_[id]; }
  bool live(int32_t id) const {
    return id >= 0 && id < static_cast<int32_t>(entries_.size()) && entries_[id].live;
  }
  int64_t size() const { return static_cast<int64_t>(entries_.size() - free_.size()); }
  // Every live id (for audits and reports).
  template <typename F>
  void ForEach(F f) const {
    for (int32_t i = 0; i < static_cast<int32_t>(entries_.size()); ++i)
      if (entries_[i].live) f(i, entries_[i]);
  }

 private:
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;
};

}  // namespace attnd
