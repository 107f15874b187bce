#include "kv_store/sequence_table.h"

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/status_macros.h"

namespace attnd {

SequenceTable::SequenceTable(std::vector<std::string> device_names,
                             const std::vector<int32_t>& pages_per_device, int32_t page_size,
                             SequenceLimits limits, TierSlots tiers)
    : names_(std::move(device_names)),
      counts_(pages_per_device.size(), 0),
      limits_(limits),
      page_size_(page_size),
      host_(tiers.host),
      disk_(tiers.disk),
      cache_tier_(tiers.disk > 0   ? Tier::kDisk
                  : tiers.host > 0 ? Tier::kHost
                                   : Tier::kDevice) {
  for (int32_t n : pages_per_device) {
    pools_.emplace_back(n);
    owner_.emplace_back(pools_.back().num_pages(), -1);
  }
}

int32_t SequenceTable::NewPage(int device, int32_t page) {
  const int32_t id = dir_.Add(device, Tier::kDevice, page, Tier::kDevice);
  owner_[device][page] = id;
  return id;
}

void SequenceTable::Hold(int32_t id, Tier holder) {
  PageDirectory::Entry& e = dir_.at(id);
  const bool was = CacheOnly(e);
  ++e.holders[static_cast<int>(holder)];
  if (e.tier == Tier::kDevice) pools_[e.device].Ref(e.slot);
  cache_only_ += int{CacheOnly(e)} - int{was};
}

void SequenceTable::Drop(int32_t id, Tier holder) {
  PageDirectory::Entry& e = dir_.at(id);
  const bool was = CacheOnly(e);
  --e.holders[static_cast<int>(holder)];
  if (e.tier == Tier::kDevice) pools_[e.device].Unref(e.slot);  // its last: the page is free
  cache_only_ += int{CacheOnly(e)} - int{was};
  RemoveIfUnheld(id);
}

void SequenceTable::RemoveIfUnheld(int32_t id) {
  const PageDirectory::Entry& e = dir_.at(id);
  // A moving page without holders goes at EndTierMove, a page being read at UnpinTierRows.
  if (e.refs() > 0 || e.busy()) return;
  if (e.tier == Tier::kDevice) owner_[e.device][e.slot] = -1;
  if (e.tier == Tier::kHost) host_.Free(e.slot);
  if (e.tier == Tier::kDisk) disk_.Free(e.slot);
  dir_.Remove(id);
}

bool SequenceTable::Reserve(Tier tier, int device, int32_t* slot) {
  if (FreeSlots(tier, device) == 0) MakeFree(tier, device, 1);
  std::vector<int32_t> got;
  const bool ok = tier == Tier::kDevice ? pools_[device].Allocate(1, &got)
                  : tier == Tier::kHost ? host_.Allocate(1, &got)
                                        : disk_.Allocate(1, &got);
  if (ok) *slot = got[0];
  return ok;
}

void SequenceTable::FreeSlot(Tier tier, int device, int32_t slot) {
  if (tier == Tier::kDevice) {
    pools_[device].Unref(slot);
    owner_[device][slot] = -1;
  } else if (tier == Tier::kHost) {
    host_.Free(slot);
  } else {
    disk_.Free(slot);
  }
}

absl::Status SequenceTable::CheckInvariants() const {
  auto bad = [](auto&&... what) { return absl::InternalError(absl::StrCat(what...)); };
  // Holders as the sequences say.
  std::map<int32_t, std::array<int32_t, kNumTiers>> holders;
  int64_t at_tier[kNumTiers] = {0, 0, 0};
  for (const auto& [key, ptr] : seqs_) {
    const Sequence& seq = *ptr;
    if (!seq.lost) ++at_tier[static_cast<int>(seq.tier)];
    if (seq.moving || seq.copying || seq.filling || seq.step != 0)
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

absl::Status SequenceTable::OnDevice(const Sequence& seq) const {
  if (seq.lost)
    return absl::DataLossError(absl::StrCat(
        "sequence ", Quote(seq.id),
        " lost its cached pages (a page of it could not be read back from the disk tier); close "
        "it and prefill it again"));
  if (seq.moving)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(seq.id), " is moving between tiers; retry"));
  if (seq.tier != Tier::kDevice)
    return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(seq.id), " is at the ",
                                                      TierName(seq.tier),
                                                      " tier; restore it to the device first"));
  return absl::OkStatus();
}

std::vector<const Sequence*> SequenceTable::List(const std::string* tenant) const {
  std::vector<const Sequence*> out;
  for (const auto& [key, seq] : seqs_)
    if (tenant == nullptr || key.tenant == *tenant) out.push_back(seq.get());
  return out;
}

Sequence* SequenceTable::Find(const SequenceKey& key) {
  auto it = seqs_.find(key);
  return it == seqs_.end() ? nullptr : it->second.get();
}

const Sequence* SequenceTable::Find(const SequenceKey& key) const {
  auto it = seqs_.find(key);
  return it == seqs_.end() ? nullptr : it->second.get();
}

absl::Status SequenceTable::NotFound(const SequenceKey& key) const {
  return absl::NotFoundError(absl::StrCat("sequence ", Quote(key.id), " not found"));
}

absl::Status SequenceTable::CheckNewId(const SequenceKey& key) const {
  const std::string& id = key.id;
  if (id.empty()) return absl::InvalidArgumentError("sequence id: empty");
  if (id.size() > limits_.max_id_bytes)
    return absl::InvalidArgumentError(absl::StrCat("sequence id ", Quote(id), ": longer than ",
                                                   limits_.max_id_bytes,
                                                   " bytes (--max-id-bytes)"));
  if (seqs_.contains(key))
    return absl::AlreadyExistsError(absl::StrCat("sequence ", Quote(id), " already exists"));
  if (size() >= limits_.max_sequences)
    return absl::ResourceExhaustedError(
        absl::StrCat("open sequences: the server holds its limit of ", limits_.max_sequences,
                     " (--max-sequences); close some first"));
  return tenants_.CheckSequences(key.tenant, 1);
}

int SequenceTable::Place() const {
  int best = 0;
  for (int i = 1; i < num_devices(); ++i)
    if (pools_[i].free_pages() > pools_[best].free_pages()) best = i;
  return best;
}

absl::Status SequenceTable::CheckDevice(int device) const {
  if (device >= num_devices())
    return absl::OutOfRangeError(
        absl::StrCat("device ", device, " outside [0, ", num_devices(), ")"));
  return absl::OkStatus();
}

absl::Status SequenceTable::Open(const SequenceKey& key, int device) {
  if (absl::Status s = CheckNewId(key); !s.ok()) return s;
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  auto seq = std::make_unique<Sequence>();
  seq->tenant = key.tenant;
  seq->id = key.id;
  seq->device = device < 0 ? Place() : device;
  Insert(std::move(seq));
  return absl::OkStatus();
}

void SequenceTable::Charge(const Sequence& seq, int64_t pages) {
  if (seq.standby) {
    standby_pages_ += pages;
  } else {
    tenants_.AddPages(seq.tenant, pages);
  }
}

void SequenceTable::ChargeSequences(const Sequence& seq, int64_t n) {
  if (seq.standby) {
    standby_seqs_ += n;
  } else {
    tenants_.AddSequences(seq.tenant, n);
  }
}

absl::Status SequenceTable::OpenStandby(const SequenceKey& key, uint64_t generation) {
  if (generation == 0 || generation > kMaxGeneration)
    return absl::InvalidArgumentError(
        absl::StrCat("standby generation: ", generation, " outside [1, 2^62]"));
  absl::Status s = CheckNewId(key);
  // The tenant's sequence quota does not count standby copies.
  if (!s.ok() && !(absl::IsResourceExhausted(s) && size() < limits_.max_sequences)) return s;
  auto seq = std::make_unique<Sequence>();
  seq->tenant = key.tenant;
  seq->id = key.id;
  seq->device = Place();
  seq->generation = generation;
  seq->standby = true;
  Insert(std::move(seq));
  return absl::OkStatus();
}

absl::Status SequenceTable::CheckStandbyPages(int64_t pages) const {
  if (standby_budget_ < 0 || standby_pages_ + pages <= standby_budget_) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("standby budget: copies hold ", standby_pages_,
                                                   " of ", standby_budget_, " pages, ", pages,
                                                   " more do not fit (--standby-cache-bytes)"));
}

absl::Status SequenceTable::Promote(const SequenceKey& key, uint64_t generation, int64_t length) {
  Sequence* seq = Find(key);
  if (seq == nullptr) return NotFound(key);
  const std::string& id = key.id;
  if (!seq->standby || seq->generation != generation)
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(id), " is ", seq->standby ? "a standby copy" : "a primary",
        " at generation ", seq->generation, ", not a standby at generation ", generation));
  if (seq->step != 0 || seq->copying || seq->moving)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is busy (a step, copy or tier move); retry"));
  if (seq->lost) return OnDevice(*seq);
  if (length < 0) return absl::OutOfRangeError(absl::StrCat("length ", length, " < 0"));
  if (length < seq->length) {  // cut back: the pages past `length` go
    const size_t keep = static_cast<size_t>((length + page_size_ - 1) / page_size_);
    if (length % page_size_ != 0 && dir_.at(seq->logical[keep - 1]).refs() > 1)
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", Quote(id), ": the page holding token ", length, " is shared; retry"));
    for (size_t k = keep; k < seq->logical.size(); ++k) Drop(seq->logical[k], seq->tier);
    standby_pages_ -= static_cast<int64_t>(seq->logical.size() - keep);
    seq->logical.resize(keep);
    if (!seq->pages.empty()) seq->pages.resize(keep);
    seq->length = length;
  }
  standby_pages_ -= static_cast<int64_t>(seq->logical.size());
  --standby_seqs_;
  seq->standby = false;
  seq->generation = generation + 1;
  ChargeSequences(*seq, 1);
  Charge(*seq, static_cast<int64_t>(seq->logical.size()));
  seq->last_used = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

void SequenceTable::Insert(std::unique_ptr<Sequence> seq) {
  ++counts_[seq->device];
  ++at_tier_[static_cast<int>(seq->tier)];
  ChargeSequences(*seq, 1);
  Charge(*seq, static_cast<int64_t>(seq->logical.size()));
  SequenceKey key(seq->tenant, seq->id);
  seqs_.emplace(std::move(key), std::move(seq));
}

void SequenceTable::Erase(Sequence* seq) {
  for (int32_t id : seq->logical) Drop(id, seq->tier);
  --counts_[seq->device];
  if (!seq->lost) --at_tier_[static_cast<int>(seq->tier)];
  Charge(*seq, -static_cast<int64_t>(seq->logical.size()));
  ChargeSequences(*seq, -1);
  seqs_.erase(SequenceKey(seq->tenant, seq->id));
  TrimCache();
}

absl::Status SequenceTable::Close(const SequenceKey& key) {
  Sequence* seq = Find(key);
  const std::string& id = key.id;
  if (seq == nullptr) return NotFound(key);
  if (seq->step != 0)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is in open step ", seq->step, "; abort it first"));
  if (seq->copying)
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(id), " is being copied (fork or migration); close it afterwards"));
  if (seq->moving)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is moving between tiers; close it afterwards"));
  Erase(seq);
  return absl::OkStatus();
}

bool SequenceTable::PlanCopy(const std::vector<int32_t>& pages, int64_t length, int to,
                             PageMove* move) {
  const int32_t n = static_cast<int32_t>((length + page_size_ - 1) / page_size_);
  const size_t first = move->fresh.size();
  if (!MakeFree(Tier::kDevice, to, n) || !pools_[to].Allocate(n, &move->fresh)) return false;
  for (int32_t i = 0; i < n; ++i) {
    const int rows =
        static_cast<int>(std::min<int64_t>(page_size_, length - int64_t{i} * page_size_));
    move->copies.push_back({pages[i], move->fresh[first + i], rows});
  }
  return true;
}

void SequenceTable::Pin(PageMove* move) {
  for (const PageCopy& c : move->copies) {
    const int32_t id = owner_[move->from][c.src];
    Hold(id, Tier::kDevice);
    move->pinned.push_back(id);
  }
  pins_ += static_cast<int64_t>(move->pinned.size());
}

void SequenceTable::Unpin(const PageMove& move) {
  for (int32_t id : move.pinned) Drop(id, Tier::kDevice);
  pins_ -= static_cast<int64_t>(move.pinned.size());
}

absl::Status SequenceTable::BeginFork(const SequenceKey& key, const std::string& parent,
                                      int64_t prefix_len, int device, PageMove* move) {
  const Sequence* par = Find(SequenceKey(key.tenant, parent));
  if (par == nullptr)
    return absl::NotFoundError(absl::StrCat("fork parent ", Quote(parent), " not found"));
  if (absl::Status s = CheckNewId(key); !s.ok()) return s;
  if (prefix_len < 0 || prefix_len > par->length)
    return absl::OutOfRangeError(absl::StrCat("fork prefix_len ", prefix_len, " outside [0, ",
                                              par->length, "] (parent ", Quote(parent),
                                              " length)"));
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (par->filling)
    return absl::FailedPreconditionError(absl::StrCat(
        "fork parent ", Quote(parent), " is still being forked itself; fork it afterwards"));
  if (par->standby)
    return absl::FailedPreconditionError(absl::StrCat(
        "fork parent ", Quote(parent), " is a standby copy; promote it first (failover)"));
  if (absl::Status s = OnDevice(*par); !s.ok()) return s;
  const int64_t child_pages = (prefix_len + page_size_ - 1) / page_size_;
  if (absl::Status s = tenants_.CheckPages(key.tenant, child_pages); !s.ok()) return s;
  auto seq = std::make_unique<Sequence>();
  seq->tenant = key.tenant;
  seq->id = key.id;
  seq->device = device < 0 ? par->device : device;
  seq->length = prefix_len;
  seq->copying = true;
  seq->filling = true;
  seq->hashes.assign(
      par->hashes.begin(),
      par->hashes.begin() +
          std::min<int64_t>(static_cast<int64_t>(par->hashes.size()), prefix_len / page_size_));
  *move = PageMove{par->device, seq->device, {}, {}, {}};
  if (seq->device != par->device) {
    if (!PlanCopy(par->pages, prefix_len, seq->device, move))
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV cache full on ", names_[seq->device], ": a fork across devices copies every page"));
    seq->pages = move->fresh;
    for (int32_t p : move->fresh) seq->logical.push_back(NewPage(seq->device, p));
  } else {
    const int64_t full = prefix_len / page_size_;
    const int rem = static_cast<int>(prefix_len % page_size_);
    seq->pages.reserve(full + 1);
    seq->logical.reserve(full + 1);
    seq->pages.assign(par->pages.begin(), par->pages.begin() + full);
    seq->logical.assign(par->logical.begin(), par->logical.begin() + full);
    if (rem > 0) {
      if (!MakeFree(Tier::kDevice, seq->device, 1) ||
          !pools_[seq->device].Allocate(1, &move->fresh))
        return absl::ResourceExhaustedError(
            absl::StrCat("KV cache full on ", names_[seq->device],
                         ": fork needs 1 page for the partial last page, 0 free"));
      move->copies.push_back({par->pages[full], move->fresh[0], rem});
      seq->pages.push_back(move->fresh[0]);
    }
    for (int64_t i = 0; i < full; ++i) Hold(seq->logical[i], Tier::kDevice);  // shared
    if (rem > 0) seq->logical.push_back(NewPage(seq->device, move->fresh[0]));
  }
  Pin(move);
  Insert(std::move(seq));
  return absl::OkStatus();
}

void SequenceTable::EndFork(const SequenceKey& key, const PageMove& move, bool ok) {
  Unpin(move);
  Sequence* seq = Find(key);
  seq->copying = false;
  seq->filling = false;
  if (!ok) Erase(seq);
}

absl::Status SequenceTable::BeginMigrate(const SequenceKey& key, int device, PageMove* move) {
  Sequence* seq = Find(key);
  const std::string& id = key.id;
  if (seq == nullptr) return NotFound(key);
  if (device < 0 || device >= num_devices())
    return absl::OutOfRangeError(
        absl::StrCat("device ", device, " outside [0, ", num_devices(), ")"));
  if (seq->step != 0)
    return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(id), " is in open step ",
                                                      seq->step, "; migrate between steps"));
  if (seq->copying)
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is being copied (fork or migration)"));
  if (absl::Status s = OnDevice(*seq); !s.ok()) return s;
  *move = PageMove{seq->device, device, {}, {}, {}};
  if (device == seq->device) return absl::OkStatus();
  if (!PlanCopy(seq->pages, seq->length, device, move))
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full on ", names_[device], ": migration needs ", seq->pages.size(), " pages"));
  Pin(move);
  seq->copying = true;
  return absl::OkStatus();
}

void SequenceTable::EndMigrate(const SequenceKey& key, const PageMove& move, bool ok) {
  if (move.from == move.to) return;
  Unpin(move);
  Sequence* seq = Find(key);
  seq->copying = false;
  if (!ok) {
    for (int32_t p : move.fresh) pools_[move.to].Unref(p);
    return;
  }
  for (int32_t id : seq->logical) Drop(id, Tier::kDevice);
  --counts_[seq->device];
  ++counts_[move.to];
  seq->pages = move.fresh;
  seq->logical.clear();
  for (int32_t p : move.fresh) seq->logical.push_back(NewPage(move.to, p));
  seq->device = move.to;
}

int32_t SequenceTable::PagesToGrow(const Sequence& seq, int64_t new_len) const {
  return static_cast<int32_t>((new_len + page_size_ - 1) / page_size_ -
                              static_cast<int64_t>(seq.logical.size()));
}

void SequenceTable::Bind(Sequence* seq, uint64_t step, int64_t new_len,
                         std::vector<int32_t>* new_pages) {
  const int32_t grow = PagesToGrow(*seq, new_len);
  pools_[seq->device].Allocate(grow, new_pages);
  Charge(*seq, grow);
  seq->step = step;
  seq->last_used = std::chrono::steady_clock::now();
}

void SequenceTable::Unbind(Sequence* seq, const std::vector<int32_t>& new_pages, int64_t new_len,
                           bool commit, absl::Span<const BlockHash> completed, bool index) {
  seq->step = 0;
  seq->last_used = std::chrono::steady_clock::now();
  if (commit) {
    seq->pages.insert(seq->pages.end(), new_pages.begin(), new_pages.end());
    for (int32_t p : new_pages) seq->logical.push_back(NewPage(seq->device, p));
    const int64_t old_len = seq->length;
    seq->length = new_len;
    const size_t first = static_cast<size_t>(old_len / page_size_);
    for (size_t k = 0; k < completed.size(); ++k)  // checked: equal to any it knew
      if (first + k >= seq->hashes.size()) seq->hashes.push_back(completed[k]);
    if (index) {
      IndexBlocks(seq, old_len);
    } else {
      seq->hashes.clear();
      seq->tokens.clear();
    }
  } else {
    for (int32_t p : new_pages) pools_[seq->device].Unref(p);
    Charge(*seq, -static_cast<int64_t>(new_pages.size()));
  }
}

absl::StatusOr<const Sequence*> SequenceTable::WithRows(const SequenceKey& key, int64_t begin,
                                                        int64_t end) const {
  const Sequence* seq = Find(key);
  if (seq == nullptr) return NotFound(key);
  if (begin < 0 || end < begin || end > seq->length)
    return absl::OutOfRangeError(absl::StrCat("rows [", begin, ", ", end, ") outside the ",
                                              seq->length, " committed tokens of ", Quote(key.id)));
  return seq;
}

absl::Status SequenceTable::PinRows(const SequenceKey& key, int64_t begin, int64_t end, int* device,
                                    std::vector<int32_t>* pages) {
  ASSIGN_OR_RETURN(const Sequence* seq, WithRows(key, begin, end));
  const std::string& id = key.id;
  if (seq->filling)
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
  if (seq->lost || seq->moving) return OnDevice(*seq);
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
  if (seq->moving) return false;
  for (int32_t p : seq->logical)
    if (dir_.at(p).busy()) return false;
  return true;
}

// ---- tiers ----

absl::Status SequenceTable::BeginTierMove(const SequenceKey& key, Tier to, TierMove* move) {
  Sequence* seq = Find(key);
  if (seq == nullptr) return NotFound(key);
  *move = TierMove();
  move->key = key;
  move->device = seq->device;
  move->from = move->to = seq->tier;
  if (seq->lost) return OnDevice(*seq);
  const std::string& id = key.id;
  if (seq->step != 0 || seq->copying || seq->filling || seq->moving)
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
  seq->moving = true;
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
  }
  if (Sequence* seq = move.key.id.empty() ? nullptr : Find(move.key)) {
    seq->moving = false;
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
    if (seq->lost) continue;
    bool holds = false;
    for (int32_t p : seq->logical)
      holds = holds || std::find(ids.begin(), ids.end(), p) != ids.end();
    if (!holds) continue;
    for (int32_t p : seq->logical) Drop(p, seq->tier);
    Charge(*seq, -static_cast<int64_t>(seq->logical.size()));
    --at_tier_[static_cast<int>(seq->tier)];
    seq->logical.clear();
    seq->pages.clear();
    seq->lost = true;
    out.push_back(key);
  }
  return out;
}

std::vector<SequenceKey> SequenceTable::Victims(Tier tier, int device, int32_t need,
                                                const std::vector<const Sequence*>& keep) const {
  std::vector<const Sequence*> cands;
  for (const auto& [key, seq] : seqs_)
    if (seq->tier == tier && (device < 0 || seq->device == device) && seq->step == 0 &&
        !seq->copying && !seq->filling && !seq->moving && !seq->lost &&
        std::find(keep.begin(), keep.end(), seq.get()) == keep.end())
      cands.push_back(seq.get());
  // Standby copies first (a copy is read only if its primary fails), then least recently used.
  std::sort(cands.begin(), cands.end(), [](const Sequence* a, const Sequence* b) {
    return std::make_tuple(!a->standby, a->last_used, std::cref(a->tenant), std::cref(a->id)) <
           std::make_tuple(!b->standby, b->last_used, std::cref(b->tenant), std::cref(b->id));
  });
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

// ---- the prefix cache ----

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
  for (int32_t b : run) slowest = std::max(slowest, dir_.at(prefix_.at(b).page).tier);
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
