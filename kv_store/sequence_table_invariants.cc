// The sequence table's invariant checker (kv_store/sequence_table.h: CheckInvariants), on its own.
// Moved out of sequence_table.cc unchanged.
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

absl::Status SequenceTable::CheckInvariants() const {
  auto bad = [](auto&&... what) { return absl::InternalError(absl::StrCat(what...)); };
  // Holders as the sequences say.
  std::map<int32_t, std::array<int32_t, kNumTiers>> holders;
  int64_t at_tier[kNumTiers] = {0, 0, 0};
  for (const auto& [key, ptr] : seqs_) {
    const Sequence& seq = *ptr;
    if (!seq.lost()) ++at_tier[static_cast<int>(seq.tier)];
    if (seq.step != 0 || seq.copying() || seq.moving())
      return bad("sequence '", seq.id, "' is busy");
    for (int32_t id : seq.logical) {
      if (!dir_.live(id)) return bad("sequence '", seq.id, "' holds a dead page ", id);
      ++holders[id][static_cast<int>(seq.tier)];
    }
    if (seq.tier == Tier::kDevice) {
      if (seq.pages.size() != seq.logical.size())
        return bad("sequence '", seq.id, "': ", seq.pages.size(), " device pages for ",
                   seq.logical.size());
      for (size_t i = 0; i < seq.pages.size(); ++i) {
        const PageDirectory::Entry& e = dir_.at(seq.logical[i]);
        if (e.tier != Tier::kDevice || e.device != seq.device || e.slot != seq.pages[i])
          return bad("sequence '", seq.id, "' page ", i, " is not its device page");
      }
    } else if (!seq.pages.empty()) {
      return bad("sequence '", seq.id, "' below its device holds device pages");
    }
  }
  // The prefix cache: one holder of each indexed block's page, at its tier; its chains whole.
  int64_t indexed = 0, cache_only = 0;
  absl::Status index_ok = absl::OkStatus();
  prefix_.ForEach([&](int32_t b, const PrefixIndex::Block& blk) {
    ++indexed;
    if (!index_ok.ok()) return;
    if (!dir_.live(blk.page) || !dir_.at(blk.page).cached)
      index_ok = bad("block ", b, ": page ", blk.page, " is not a cached page");
    else if (dir_.at(blk.page).device != blk.device)
      index_ok =
          bad("block ", b, ": device ", blk.device, ", its page's ", dir_.at(blk.page).device);
    else if (blk.parent >= 0 &&
             (!prefix_.at(blk.parent).live || prefix_.at(blk.parent).tenant != blk.tenant))
      index_ok = bad("block ", b, ": its parent ", blk.parent, " is not in its tenant's index");
    else if (prefix_.Find(blk.tenant, blk.hash) != b)
      index_ok = bad("block ", b, " is not found by its hash");
    if (!index_ok.ok()) return;
    ++holders[blk.page][static_cast<int>(cache_tier_)];
  });
  RETURN_IF_ERROR(index_ok);
  for (int t = 0; t < kNumTiers; ++t)
    if (at_tier[t] != at_tier_[t])
      return bad(TierName(static_cast<Tier>(t)), ": ", at_tier_[t], " sequences counted, ",
                 at_tier[t], " there");
  std::vector<int32_t> device_pages(pools_.size(), 0);
  int32_t host = 0, disk = 0;
  absl::Status status = absl::OkStatus();
  dir_.ForEach([&](int32_t id, const PageDirectory::Entry& e) {
    if (!status.ok()) return;
    const auto h = holders.find(id);
    const std::array<int32_t, kNumTiers> want =
        h == holders.end() ? std::array<int32_t, kNumTiers>{0, 0, 0} : h->second;
    for (int t = 0; t < kNumTiers; ++t)  // pins (PinRows: a read) add holders on the device
      if (t == 0 ? e.holders[t] < want[t] : e.holders[t] != want[t])
        status = bad("page ", id, ": ", e.holders[t], " holders at ",
                     TierName(static_cast<Tier>(t)), ", the sequences say ", want[t]);
    if (!status.ok()) return;
    if (e.refs() == 0 && e.reads == 0) status = bad("page ", id, " has no holder");
    indexed -= e.cached;
    cache_only += CacheOnly(e);
    if (e.moving) status = bad("page ", id, " is moving");
    if (e.move_pins != 0) status = bad("page ", id, " is pinned by ", e.move_pins, " move(s)");
    if (static_cast<int>(e.tier) > static_cast<int>(e.needed()))
      status =
          bad("page ", id, " is at ", TierName(e.tier), ", a holder at ", TierName(e.needed()));
    switch (e.tier) {
      case Tier::kDevice:
        if (pools_[e.device].refcount(e.slot) != e.refs())
          status = bad("page ", id, ": device count ", pools_[e.device].refcount(e.slot),
                       ", holders ", e.refs());
        if (owner_[e.device][e.slot] != id)
          status = bad("page ", id, ": ", names_[e.device], " page ", e.slot, " owned by ",
                       owner_[e.device][e.slot]);
        ++device_pages[e.device];
        break;
      case Tier::kHost:
        if (!host_.used(e.slot)) status = bad("page ", id, " in a free host slot");
        ++host;
        break;
      case Tier::kDisk:
        if (!disk_.used(e.slot)) status = bad("page ", id, " in a free disk slot");
        ++disk;
        break;
    }
  });
  RETURN_IF_ERROR(status);
  for (size_t d = 0; d < pools_.size(); ++d)
    if (pools_[d].used_pages() != device_pages[d])
      return bad(names_[d], ": ", pools_[d].used_pages(), " pages used, ", device_pages[d],
                 " in the directory");
  if (host_.used_slots() != host)
    return bad("host: ", host_.used_slots(), " slots, ", host, " pages");
  if (disk_.used_slots() != disk)
    return bad("disk: ", disk_.used_slots(), " slots, ", disk, " pages");
  if (indexed != 0) return bad("prefix cache: ", indexed, " more blocks than cached pages");
  if (cache_only != cache_only_)
    return bad("prefix cache: ", cache_only_, " cache-only pages counted, ", cache_only, " there");
  return absl::OkStatus();
}

}  // namespace attnd
