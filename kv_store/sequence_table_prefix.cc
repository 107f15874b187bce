// The sequence table's prefix cache (kv_store/sequence_table.h): cached blocks held and dropped,
// eviction of cached blocks, block hashes indexed as a sequence grows, opening on cached blocks
// and looking a prefix up. Moved out of sequence_table.cc unchanged.
#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "kv_store/sequence_table.h"

namespace attnd {

void SequenceTable::SetPrefixCache(int64_t max_cached_pages,
                                   std::function<void(const PrefixEvent&)> on_event) {
  max_cached_ = max_cached_pages;
  on_prefix_event_ = std::move(on_event);
  TrimCache();
}

void SequenceTable::CacheHold(int32_t id) {
  PageDirectory::Entry& e = dir_.at(id);
  e.cached = true;
  ++e.holders[static_cast<int>(cache_tier_)];
  if (e.tier == Tier::kDevice) pools_[e.device].Ref(e.slot);
  cache_only_ += CacheOnly(e);
}

void SequenceTable::CacheDrop(int32_t id) {
  PageDirectory::Entry& e = dir_.at(id);
  cache_only_ -= CacheOnly(e);
  e.cached = false;
  Drop(id, cache_tier_);
}

int32_t SequenceTable::RemoveBlock(int32_t block, int tier, int device) {
  int32_t freed = 0;
  std::vector<PrefixEvent> events;  // one per device the blocks are on
  prefix_.Remove(block, [&](const PrefixIndex::Block& blk) {
    const PageDirectory::Entry& e = dir_.at(blk.page);
    freed += CacheOnly(e) && (tier < 0 || static_cast<int>(e.tier) == tier) &&
             (device < 0 || e.device == device);
    if (on_prefix_event_) {
      if (events.empty() || events.back().device != blk.device) {
        events.emplace_back();
        events.back().kind = PrefixEvent::Kind::kRemoved;
        events.back().tenant = blk.tenant;
        events.back().device = blk.device;
        events.back().tier = e.tier;
      }
      events.back().hashes.push_back(blk.hash);
    }
    ++prefix_stats_.removed_blocks;
    CacheDrop(blk.page);
  });
  for (const PrefixEvent& ev : events) on_prefix_event_(ev);
  return freed;
}

int32_t SequenceTable::EvictCached(int tier, int device, int32_t need) {
  int32_t freed = 0;
  for (int round = 0; round < 64 && freed < need && cache_only_ > 0; ++round) {
    // The oldest blocks whose pages only the cache holds, as many as are needed, then removed
    // (a block removed with an older one's chain is passed over).
    std::vector<std::pair<int32_t, BlockHash>> victims;
    prefix_.Oldest([&](int32_t b) {
      const PrefixIndex::Block& blk = prefix_.at(b);
      const PageDirectory::Entry& e = dir_.at(blk.page);
      if (CacheOnly(e) && !e.busy() && (tier < 0 || static_cast<int>(e.tier) == tier) &&
          (device < 0 || e.device == device))
        victims.emplace_back(b, blk.hash);
      return static_cast<int32_t>(victims.size()) < need - freed;
    });
    if (victims.empty()) break;
    for (const auto& [b, hash] : victims)
      if (freed < need && prefix_.at(b).live && prefix_.at(b).hash == hash)
        freed += RemoveBlock(b, tier, device);
  }
  return freed;
}

int64_t SequenceTable::ClearPrefixCache() {
  const int64_t before = prefix_.size();
  std::vector<int32_t> roots;
  prefix_.ForEach([&](int32_t b, const PrefixIndex::Block& blk) {
    if (blk.parent < 0) roots.push_back(b);
  });
  for (int32_t b : roots) RemoveBlock(b, -1, -1);  // a root's chains go with it
  return before - prefix_.size();
}

void SequenceTable::TrimCache() {
  if (max_cached_ >= 0 && cache_only_ > max_cached_)
    EvictCached(-1, -1, static_cast<int32_t>(cache_only_ - max_cached_));
}

absl::Status SequenceTable::CheckBlockHashes(const Sequence& seq, int64_t new_len,
                                             absl::Span<const BlockHash> completed) const {
  if (completed.empty()) return absl::OkStatus();
  const int64_t first = seq.length / page_size_;
  const int64_t n = new_len / page_size_ - first;
  if (static_cast<int64_t>(completed.size()) != n)
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", Quote(seq.id), ": ", completed.size(), " block hashes for the ",
                     n, " blocks this step completes (blocks of ", page_size_, " tokens)"));
  if (static_cast<int64_t>(seq.hashes.size()) < first)
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", Quote(seq.id), ": block hashes for blocks ", first, "..",
                     first + n - 1, ", but only ", seq.hashes.size(), " of the ", first,
                     " before them have hashes (open it with its prompt's token ids or hashes)"));
  for (int64_t k = 0; k < n; ++k)
    if (first + k < static_cast<int64_t>(seq.hashes.size()) &&
        seq.hashes[first + k] != completed[k])
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", Quote(seq.id), ": block ", first + k, "'s hash differs from its prompt's"));
  return absl::OkStatus();
}

void SequenceTable::IndexBlocks(Sequence* seq, int64_t old_len) {
  const int64_t after =
      std::min<int64_t>(seq->length / page_size_, static_cast<int64_t>(seq->hashes.size()));
  if (after <= old_len / page_size_) return;
  std::vector<int32_t> chain;  // the block indexed for each of its blocks, in order
  PrefixEvent ev;
  auto flush = [&] {
    if (!ev.hashes.empty() && on_prefix_event_) on_prefix_event_(ev);
    ev = PrefixEvent();
  };
  const bool have_tokens = static_cast<int64_t>(seq->tokens.size()) >= after * page_size_;
  for (int64_t i = 0; i < after; ++i) {
    const int32_t parent = chain.empty() ? -1 : chain.back();
    int32_t b = prefix_.Find(seq->tenant, seq->hashes[i]);
    if (b < 0) {
      const int32_t page = seq->logical[i];
      if (dir_.at(page).cached) break;  // its page is another block's (hashes that disagree)
      b = prefix_.Insert(seq->tenant, seq->hashes[i], parent, page, seq->device);
      CacheHold(page);
      ++prefix_stats_.stored_blocks;
      if (ev.hashes.empty()) {
        ev.kind = PrefixEvent::Kind::kStored;
        ev.tenant = seq->tenant;
        ev.device = seq->device;
        ev.tier = dir_.at(page).tier;
        ev.has_parent = parent >= 0;
        if (parent >= 0) ev.parent = prefix_.at(parent).hash;
      }
      ev.hashes.push_back(seq->hashes[i]);
      if (have_tokens)
        ev.tokens.insert(ev.tokens.end(), seq->tokens.begin() + i * page_size_,
                         seq->tokens.begin() + (i + 1) * page_size_);
    } else {
      flush();
      if (prefix_.at(b).parent != parent) break;  // (equal hashes have equal parents)
    }
    chain.push_back(b);
  }
  flush();
  for (size_t i = chain.size(); i-- > 0;) prefix_.Touch(chain[i]);  // parents the newest
  if (static_cast<int64_t>(seq->tokens.size()) <= seq->length) seq->tokens.clear();
  TrimCache();
}

absl::Status SequenceTable::OpenCached(const SequenceKey& key, int device,
                                       std::vector<BlockHash> hashes, std::vector<uint32_t> tokens,
                                       int64_t max_blocks, int64_t* cached_tokens) {
  RETURN_IF_ERROR(CheckNewId(key));
  RETURN_IF_ERROR(CheckDevice(device));
  const int64_t asked = std::min<int64_t>(max_blocks, static_cast<int64_t>(hashes.size()));
  std::vector<int32_t> run;
  int dev = -1;
  Tier slowest = Tier::kDevice;
  for (int64_t i = 0; i < asked; ++i) {
    const int32_t b = prefix_.Find(key.tenant, hashes[i]);
    if (b < 0) break;
    const PrefixIndex::Block& blk = prefix_.at(b);
    const PageDirectory::Entry& e = dir_.at(blk.page);
    if (blk.parent != (run.empty() ? -1 : run.back()) || e.moving) break;
    if (dev < 0 && device >= 0 && blk.device != device) break;
    if (dev >= 0 && blk.device != dev) break;
    dev = blk.device;
    run.push_back(b);
  }
  const TenantQuota& quota = tenants_.QuotaOf(key.tenant);
  if (quota.pages > 0)
    run.resize(
        std::min<int64_t>(static_cast<int64_t>(run.size()),
                          std::max<int64_t>(0, quota.pages - tenants_.UsageOf(key.tenant).pages)));
  for (int32_t b : run) {
    const Tier at = dir_.at(prefix_.at(b).page).tier;
    slowest = std::max(slowest, at);
    ++prefix_stats_.hit_blocks_at[static_cast<int>(at)];
  }
  ++prefix_stats_.lookups;
  prefix_stats_.hit_blocks += static_cast<int64_t>(run.size());
  prefix_stats_.miss_blocks += asked - static_cast<int64_t>(run.size());
  auto seq = std::make_unique<Sequence>();
  seq->tenant = key.tenant;
  seq->id = key.id;
  seq->device = !run.empty() ? dev : device < 0 ? Place() : device;
  seq->tier = run.empty() ? Tier::kDevice : slowest;
  for (int32_t b : run) {
    const int32_t page = prefix_.at(b).page;
    Hold(page, seq->tier);
    seq->logical.push_back(page);
    if (seq->tier == Tier::kDevice) seq->pages.push_back(dir_.at(page).slot);
  }
  for (size_t i = run.size(); i-- > 0;) prefix_.Touch(run[i]);
  seq->length = static_cast<int64_t>(run.size()) * page_size_;
  seq->hashes = std::move(hashes);
  seq->tokens = std::move(tokens);
  if (static_cast<int64_t>(seq->tokens.size()) <= seq->length) seq->tokens.clear();
  *cached_tokens = seq->length;
  Insert(std::move(seq));
  return absl::OkStatus();
}

PrefixLookup SequenceTable::LookupPrefix(const std::string& tenant,
                                         absl::Span<const BlockHash> hashes) const {
  PrefixLookup out;
  int32_t parent = -1;
  for (const BlockHash& h : hashes) {
    const int32_t b = prefix_.Find(tenant, h);
    if (b < 0) break;
    const PrefixIndex::Block& blk = prefix_.at(b);
    if (blk.parent != parent || (out.device >= 0 && blk.device != out.device)) break;
    out.device = blk.device;
    ++out.blocks;
    out.on_device += dir_.at(blk.page).tier == Tier::kDevice;
    parent = b;
  }
  return out;
}

}  // namespace attnd
