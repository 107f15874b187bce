#include "kv_store/prefix_index.h"

#include <algorithm>

namespace attnd {

int32_t PrefixIndex::Find(const std::string& tenant, const BlockHash& hash) const {
  auto it = by_hash_.find(Key(tenant, hash));
  return it == by_hash_.end() ? -1 : it->second;
}

int32_t PrefixIndex::Insert(const std::string& tenant, const BlockHash& hash, int32_t parent,
                            int32_t page, int device) {
  int32_t id;
  if (free_.empty()) {
    id = static_cast<int32_t>(blocks_.size());
    blocks_.emplace_back();
  } else {
    id = free_.back();
    free_.pop_back();
  }
  Block& b = blocks_[id];
  b = Block();
  b.tenant = tenant;
  b.hash = hash;
  b.parent = parent;
  b.page = page;
  b.device = device;
  b.tick = ++clock_;
  b.live = true;
  if (parent >= 0) blocks_[parent].children.push_back(id);
  by_hash_.emplace(Key(tenant, hash), id);
  lru_.emplace(b.tick, id);
  return id;
}

void PrefixIndex::Touch(int32_t block) {
  Block& b = blocks_[block];
  lru_.erase({b.tick, block});
  b.tick = ++clock_;
  lru_.emplace(b.tick, block);
}

void PrefixIndex::Erase(int32_t block) {
  Block& b = blocks_[block];
  if (b.parent >= 0) {
    std::vector<int32_t>& sib = blocks_[b.parent].children;
    sib.erase(std::find(sib.begin(), sib.end(), block));
  }
  lru_.erase({b.tick, block});
  by_hash_.erase(Key(b.tenant, b.hash));
  b = Block();
  free_.push_back(block);
}

}  // namespace attnd
