// The sequence table's tier moves (kv_store/sequence_table.h): pinned rows, moves between the
// device, host and disk tiers, orphans, victims and the room each tier has. Moved out of
// sequence_table.cc unchanged.
#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "kv_store/sequence_table.h"

namespace attnd {

absl::Status SequenceTable::PinRows(const SequenceKey& key, int64_t begin, int64_t end, int* device,
                                    std::vector<int32_t>* pages) {
  ASSIGN_OR_RETURN(const Sequence* seq, WithRows(key, begin, end));
  const std::string& id = key.id;
  if (seq->filling())
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is still being forked; read it afterwards"));
  if (absl::Status s = OnDevice(*seq); !s.ok()) return s;
  *device = seq->device;
  pages->clear();
  if (end > begin)
    pages->assign(seq->pages.begin() + begin / page_size_,
                  seq->pages.begin() + (end - 1) / page_size_ + 1);
  for (int32_t p : *pages) Hold(owner_[*device][p], Tier::kDevice);
  pins_ += static_cast<int64_t>(pages->size());
  return absl::OkStatus();
}

void SequenceTable::Unpin(int device, const std::vector<int32_t>& pages) {
  for (int32_t p : pages) Drop(owner_[device][p], Tier::kDevice);
  pins_ -= static_cast<int64_t>(pages.size());
}

absl::Status SequenceTable::PinTierRows(const SequenceKey& key, int64_t begin, int64_t end,
                                        int* device, std::vector<TierPin>* pins) {
  ASSIGN_OR_RETURN(const Sequence* seq, WithRows(key, begin, end));
  const std::string& id = key.id;
  if (seq->lost() || seq->moving()) return OnDevice(*seq);
  if (seq->tier == Tier::kDevice)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is on the device; read it there"));
  pins->clear();
  if (end == begin) return absl::OkStatus();
  const int64_t first = begin / page_size_, last = (end - 1) / page_size_;
  for (int64_t i = first; i <= last; ++i)
    if (dir_.at(seq->logical[i]).moving)
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", Quote(id), " shares pages that are moving between tiers; retry"));
  *device = seq->device;
  for (int64_t i = first; i <= last; ++i) {
    const int32_t p = seq->logical[i];
    PageDirectory::Entry& e = dir_.at(p);
    pins->push_back({p, e.tier, e.slot});
    if (e.tier == Tier::kDevice) {
      Hold(p, Tier::kDevice);  // as PinRows: a holder on the device keeps it there
      ++pins_;
    } else {
      ++e.reads;
    }
  }
  return absl::OkStatus();
}

void SequenceTable::UnpinTierRows(const std::vector<TierPin>& pins) {
  for (const TierPin& pin : pins) {
    if (pin.tier == Tier::kDevice) {
      Drop(pin.id, Tier::kDevice);
      --pins_;
      continue;
    }
    --dir_.at(pin.id).reads;
    RemoveIfUnheld(pin.id);  // its sequence closed while it was read
  }
}

bool SequenceTable::Settled(const SequenceKey& key) const {
  const Sequence* seq = Find(key);
  if (seq == nullptr) return true;
  if (seq->moving()) return false;
  for (int32_t p : seq->logical)
    if (dir_.at(p).busy()) return false;
  return true;
}

absl::Status SequenceTable::BeginTierMove(const SequenceKey& key, Tier to, TierMove* move) {
  Sequence* seq = Find(key);
  if (seq == nullptr) return NotFound(key);
  *move = TierMove();
  move->key = key;
  move->device = seq->device;
  move->from = move->to = seq->tier;
  if (seq->lost()) return OnDevice(*seq);
  const std::string& id = key.id;
  if (!seq->idle())
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is busy (in a step, a copy or a move); retry"));
  const Tier from = seq->tier;
  if (from == to) return absl::OkStatus();
  if ((to == Tier::kHost && host_.slots() == 0) || (to == Tier::kDisk && disk_.slots() == 0))
    return absl::FailedPreconditionError(
        absl::StrCat("the ", TierName(to), " tier is off on this server"));
  for (int32_t p : seq->logical)
    if (dir_.at(p).busy())
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(id),
                       " shares pages that are moving between tiers or being read; retry"));
  // Its holds move to `to`; then every page goes where its holders need it.
  auto transfer = [&](Tier a, Tier b) {
    for (int32_t p : seq->logical) {
      PageDirectory::Entry& e = dir_.at(p);
      --e.holders[static_cast<int>(a)];
      ++e.holders[static_cast<int>(b)];
    }
  };
  transfer(from, to);
  int32_t need[kNumTiers] = {0, 0, 0};
  for (int32_t p : seq->logical) {
    const PageDirectory::Entry& e = dir_.at(p);
    if (e.needed() != e.tier) ++need[static_cast<int>(e.needed())];
  }
  const int32_t have[kNumTiers] = {Room(Tier::kDevice, seq->device), Room(Tier::kHost, -1),
                                   Room(Tier::kDisk, -1)};
  for (int t = 0; t < kNumTiers; ++t)
    if (need[t] > have[t]) {
      transfer(to, from);
      return absl::ResourceExhaustedError(
          absl::StrCat(TierName(static_cast<Tier>(t)), " tier full",
                       t == 0 ? absl::StrCat(" on ", names_[seq->device]) : std::string(),
                       ": moving ", Quote(id), " to the ", TierName(to), " tier needs ", need[t],
                       " pages there, ", have[t], " free"));
    }
  for (int32_t p : seq->logical) {
    PageDirectory::Entry& e = dir_.at(p);
    if (e.needed() == e.tier) continue;
    TierMove::Page m;
    m.id = p;
    m.from = e.tier;
    m.src = e.slot;
    m.to = e.needed();
    if (!Reserve(m.to, seq->device, &m.dst)) {  // counted above: a bug, undone
      for (const TierMove::Page& r : move->pages) {
        FreeSlot(r.to, seq->device, r.dst);
        if (r.from == Tier::kDevice) pools_[seq->device].Unref(r.src);
        dir_.at(r.id).moving = false;
      }
      move->pages.clear();
      transfer(to, from);
      return absl::InternalError(absl::StrCat("moving ", Quote(id), " to the ", TierName(to),
                                              " tier: a slot counted free could not be taken"));
    }
    if (m.from == Tier::kDevice) pools_[seq->device].Ref(m.src);  // the copy's own hold
    e.moving = true;
    move->pages.push_back(m);
  }
  // The pages it shares and leaves where they are stay there until the move ends: a failed move
  // takes its holds back to them (another sequence's move would otherwise carry them off).
  for (int32_t p : seq->logical) {
    PageDirectory::Entry& e = dir_.at(p);
    if (e.moving) continue;
    ++e.move_pins;
    move->pinned.push_back(p);
  }
  seq->tier = to;
  seq->state = SequenceState::kMoving;
  move->to = to;
  return absl::OkStatus();
}

std::array<int32_t, kNumTiers> SequenceTable::MoveNeeds(const SequenceKey& key, Tier to) const {
  std::array<int32_t, kNumTiers> need = {0, 0, 0};
  const Sequence* seq = Find(key);
  if (seq == nullptr || seq->tier == to) return need;
  for (int32_t p : seq->logical) {
    PageDirectory::Entry e = dir_.at(p);  // a copy: the holds as they would be
    --e.holders[static_cast<int>(seq->tier)];
    ++e.holders[static_cast<int>(to)];
    if (e.needed() != e.tier) ++need[static_cast<int>(e.needed())];
  }
  return need;
}

void SequenceTable::BeginOrphanMove(Tier tier, int device, int32_t max_pages, TierMove* move) {
  *move = TierMove();
  move->device = device;
  move->from = move->to = tier;
  dir_.ForEach([&](int32_t id, const PageDirectory::Entry& entry) {
    if (static_cast<int32_t>(move->pages.size()) >= max_pages) return;
    if (entry.tier != tier || entry.busy() || (device >= 0 && entry.device != device)) return;
    if (entry.needed() <= tier) return;  // a holder needs it here (or it is needed faster)
    TierMove::Page m;
    m.id = id;
    m.from = tier;
    m.src = entry.slot;
    m.to = entry.needed();
    const int on = entry.device;
    if (!Reserve(m.to, on, &m.dst)) return;
    // Making room there may have evicted a cached block whose chain held this page (removing
    // it), or changed who needs it: then it stays, and so does the slot.
    PageDirectory::Entry& e = dir_.at(id);
    if (!e.live || e.tier != tier || e.slot != m.src || e.device != on || e.busy() ||
        e.needed() != m.to) {
      FreeSlot(m.to, on, m.dst);
      return;
    }
    if (m.from == Tier::kDevice) pools_[e.device].Ref(m.src);
    e.moving = true;
    move->pages.push_back(m);
  });
}

std::vector<SequenceKey> SequenceTable::EndTierMove(const TierMove& move, bool ok,
                                                    const std::vector<int32_t>& lost) {
  for (int32_t p : move.pinned) --dir_.at(p).move_pins;
  std::vector<std::pair<int32_t, Tier>> moved_blocks;  // indexed pages moved, from where
  for (const TierMove::Page& m : move.pages) {
    PageDirectory::Entry& e = dir_.at(m.id);
    e.moving = false;
    const int d = e.device;
    if (m.from == Tier::kDevice) pools_[d].Unref(m.src);  // the copy's own hold
    if (!ok || e.refs() == 0) {  // stays where it was; a page without holders goes entirely
      FreeSlot(m.to, d, m.dst);
      if (e.refs() == 0) {
        if (m.from != Tier::kDevice) FreeSlot(m.from, d, m.src);
        if (m.from == Tier::kDevice) owner_[d][m.src] = -1;
        dir_.Remove(m.id);
      }
      continue;
    }
    // The bytes are at the destination: leave the source, take the destination.
    if (m.from == Tier::kDevice) {
      for (int32_t r = 0; r < e.refs(); ++r) pools_[d].Unref(m.src);
      owner_[d][m.src] = -1;
    } else {
      FreeSlot(m.from, d, m.src);
    }
    e.tier = m.to;
    e.slot = m.dst;
    if (m.to == Tier::kDevice) {
      for (int32_t r = 1; r < e.refs(); ++r) pools_[d].Ref(m.dst);
      owner_[d][m.dst] = m.id;
    }
    if (e.cached && m.from != m.to) moved_blocks.emplace_back(m.id, m.from);
  }
  AnnounceTierMoves(moved_blocks);
  if (Sequence* seq = move.key.id.empty() ? nullptr : Find(move.key)) {
    seq->state = SequenceState::kIdle;
    if (!ok && move.from != move.to) {
      for (int32_t p : seq->logical) {
        PageDirectory::Entry& e = dir_.at(p);
        --e.holders[static_cast<int>(move.to)];
        ++e.holders[static_cast<int>(move.from)];
      }
      seq->tier = move.from;
    } else if (move.from != move.to) {
      --at_tier_[static_cast<int>(move.from)];
      ++at_tier_[static_cast<int>(move.to)];
    }
    seq->pages.clear();
    if (seq->tier == Tier::kDevice)
      for (int32_t p : seq->logical) seq->pages.push_back(dir_.at(p).slot);
  }
  return LoseHolders(lost);
}

void SequenceTable::AnnounceTierMoves(const std::vector<std::pair<int32_t, Tier>>& moved) {
  if (moved.empty() || !on_prefix_event_) return;
  // Each indexed block whose page moved: removed where it was, stored where it is (vLLM's
  // events name the medium; a subscriber that keys blocks by medium follows the move).
  const absl::flat_hash_map<int32_t, Tier> left(moved.begin(), moved.end());  // page -> tier
  prefix_.ForEach([&](int32_t, const PrefixIndex::Block& blk) {
    auto it = left.find(blk.page);
    if (it == left.end()) return;
    PrefixEvent gone;
    gone.kind = PrefixEvent::Kind::kRemoved;
    gone.tenant = blk.tenant;
    gone.device = blk.device;
    gone.tier = it->second;
    gone.hashes = {blk.hash};
    on_prefix_event_(gone);
    PrefixEvent here = gone;
    here.kind = PrefixEvent::Kind::kStored;
    here.tier = dir_.at(blk.page).tier;
    here.has_parent = blk.parent >= 0;
    if (blk.parent >= 0) here.parent = prefix_.at(blk.parent).hash;
    on_prefix_event_(here);
  });
}

std::vector<SequenceKey> SequenceTable::LoseHolders(const std::vector<int32_t>& ids) {
  std::vector<SequenceKey> out;
  if (ids.empty()) return out;
  // Blocks whose bytes are gone leave the index (with the blocks after them).
  std::vector<std::pair<int32_t, BlockHash>> gone;
  prefix_.ForEach([&](int32_t b, const PrefixIndex::Block& blk) {
    if (std::find(ids.begin(), ids.end(), blk.page) != ids.end()) gone.emplace_back(b, blk.hash);
  });
  for (const auto& [b, hash] : gone)
    if (prefix_.at(b).live && prefix_.at(b).hash == hash) RemoveBlock(b, -1, -1);
  for (auto& [key, seq] : seqs_) {
    if (seq->lost()) continue;
    bool holds = false;
    for (int32_t p : seq->logical)
      holds = holds || std::find(ids.begin(), ids.end(), p) != ids.end();
    if (!holds) continue;
    for (int32_t p : seq->logical) Drop(p, seq->tier);
    Charge(*seq, -static_cast<int64_t>(seq->logical.size()));
    --at_tier_[static_cast<int>(seq->tier)];
    seq->logical.clear();
    seq->pages.clear();
    seq->state = SequenceState::kLost;
    out.push_back(key);
  }
  return out;
}

std::vector<SequenceKey> SequenceTable::Victims(Tier tier, int device, int32_t need,
                                                const std::vector<const Sequence*>& keep) const {
  std::vector<const Sequence*> cands;
  for (const auto& [key, seq] : seqs_)
    if (seq->tier == tier && (device < 0 || seq->device == device) && seq->idle() &&
        std::find(keep.begin(), keep.end(), seq.get()) == keep.end())
      cands.push_back(seq.get());
  eviction_->Rank(cands);
  std::vector<SequenceKey> out;
  int32_t freed = 0;
  for (const Sequence* seq : cands) {
    if (freed >= need) break;
    int32_t mine = 0;   // slots only it holds at this tier
    bool busy = false;  // a page of it moving or read: it cannot move now
    for (int32_t p : seq->logical) {
      const PageDirectory::Entry& e = dir_.at(p);
      busy = busy || e.busy();
      mine += e.tier == tier && e.holders[static_cast<int>(tier)] == 1 &&
              (tier != Tier::kHost || e.holders[0] == 0);
    }
    if (busy || mine == 0) continue;
    freed += mine;
    out.emplace_back(seq->tenant, seq->id);
  }
  return out;
}

int32_t SequenceTable::Orphans(Tier tier, int device) const {
  int32_t n = 0;
  dir_.ForEach([&](int32_t, const PageDirectory::Entry& e) {
    n += e.tier == tier && !e.busy() && (device < 0 || e.device == device) && e.needed() > tier;
  });
  return n;
}

int32_t SequenceTable::FreeSlots(Tier tier, int device) const {
  return tier == Tier::kDevice ? pools_[device].free_pages()
         : tier == Tier::kHost ? host_.free_slots()
                               : disk_.free_slots();
}

int32_t SequenceTable::CachedOnly(Tier tier, int device) const {
  if (cache_only_ == 0) return 0;
  int32_t n = 0;
  prefix_.ForEach([&](int32_t, const PrefixIndex::Block& blk) {
    const PageDirectory::Entry& e = dir_.at(blk.page);
    n += CacheOnly(e) && !e.busy() && e.tier == tier &&
         (tier != Tier::kDevice || device < 0 || e.device == device);
  });
  return n;
}

int32_t SequenceTable::Room(Tier tier, int device) const {
  return FreeSlots(tier, device) + (tier == cache_tier_ ? CachedOnly(tier, device) : 0);
}

bool SequenceTable::MakeFree(Tier tier, int device, int32_t n) {
  const int32_t free = FreeSlots(tier, device);
  // Host and disk slots serve every device: any device's cached blocks there make room.
  if (free < n && tier == cache_tier_ && cache_only_ > 0)
    EvictCached(static_cast<int>(tier), tier == Tier::kDevice ? device : -1, n - free);
  return FreeSlots(tier, device) >= n;
}

}  // namespace attnd
