// The prefix cache's index (docs/prefix_cache.md): per tenant, a block hash (common/block_hash.h)
// names one cached page, the page holding that block's rows in every layer. Blocks form the
// chains their hashes make: a block's parent is the block before it, so a prompt's cached prefix
// is the longest run of its hashes found from the first. A block whose parent leaves the index
// leaves with it (it could never be found again), so every indexed block is reachable.
// Recency: each block has a tick; Oldest() walks blocks least recently used first.
// Only the index: the sequence table holds the pages (one holder per block) and decides what
// leaves. Not thread safe (the engine's lock).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/block_hash.h"

namespace attnd {

class PrefixIndex {
 public:
  struct Block {
    std::string tenant;
    BlockHash hash{};
    int32_t parent = -1;  // the block before it, -1 for a first block
    std::vector<int32_t> children;
    int32_t page = -1;  // its page's directory id (kv_store/page_directory.h)
    int device = 0;
    uint64_t tick = 0;  // last use
    bool live = false;
  };

  // The block of `hash` in `tenant`'s cache, or -1.
  int32_t Find(const std::string& tenant, const BlockHash& hash) const;
  // A new block (the hash must be absent); `parent` is a live block of the same tenant or -1.
  int32_t Insert(const std::string& tenant, const BlockHash& hash, int32_t parent, int32_t page,
                 int device);
  // Marks a block just used.
  void Touch(int32_t block);
  // Removes `block` and every block after it in its chains (children first), calling
  // f(const Block&) for each before it goes.
  template <typename F>
  void Remove(int32_t block, F f) {
    while (!blocks_[block].children.empty()) Remove(blocks_[block].children.back(), f);
    f(static_cast<const Block&>(blocks_[block]));
    Erase(block);
  }
  const Block& at(int32_t block) const { return blocks_[block]; }
  int64_t size() const { return static_cast<int64_t>(by_hash_.size()); }
  // Blocks least recently used first; f(block id) returns false to stop. The index may not
  // change during the walk.
  template <typename F>
  void Oldest(F f) const {
    for (const auto& [tick, id] : lru_)
      if (!f(id)) return;
  }
  template <typename F>
  void ForEach(F f) const {
    for (int32_t i = 0; i < static_cast<int32_t>(blocks_.size()); ++i)
      if (blocks_[i].live) f(i, blocks_[i]);
  }

 private:
  using Key = std::pair<std::string, BlockHash>;
  void Erase(int32_t block);

  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  absl::flat_hash_map<Key, int32_t> by_hash_;
  std::set<std::pair<uint64_t, int32_t>> lru_;
  uint64_t clock_ = 0;
};

}  // namespace attnd
