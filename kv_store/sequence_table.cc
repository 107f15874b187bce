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

absl::Status SequenceTable::OnDevice(const Sequence& seq) const {
  if (seq.lost())
    return absl::DataLossError(absl::StrCat(
        "sequence ", Quote(seq.id),
        " lost its cached pages (a page of it could not be read back from the disk tier); close "
        "it and prefill it again"));
  if (seq.moving())
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
  if (seq->step != 0 || seq->copying() || seq->moving())
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is busy (a step, copy or tier move); retry"));
  if (seq->lost()) return OnDevice(*seq);
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
  if (seq->hashes.size() > static_cast<size_t>(seq->length / page_size_))
    seq->hashes.resize(seq->length / page_size_);  // the cut blocks' hashes go with them
  standby_pages_ -= static_cast<int64_t>(seq->logical.size());
  --standby_seqs_;
  prefix_stats_.promoted_tokens += seq->length;
  seq->standby = false;
  seq->generation = generation + 1;
  ChargeSequences(*seq, 1);
  Charge(*seq, static_cast<int64_t>(seq->logical.size()));
  seq->last_used = std::chrono::steady_clock::now();
  // Its blocks join this replica's prefix cache (and KV events) now; a spilled one's at its
  // next commit, which indexes every block it knows from the first.
  if (seq->tier == Tier::kDevice) IndexBlocks(seq, 0);
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
  if (!seq->lost()) --at_tier_[static_cast<int>(seq->tier)];
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
  if (seq->copying())
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(id), " is being copied (fork or migration); close it afterwards"));
  if (seq->moving())
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
  if (par->filling())
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
  seq->state = SequenceState::kForking;
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
  seq->state = SequenceState::kIdle;
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
  if (seq->copying())
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Quote(id), " is being copied (fork or migration)"));
  if (absl::Status s = OnDevice(*seq); !s.ok()) return s;
  *move = PageMove{seq->device, device, {}, {}, {}};
  if (device == seq->device) return absl::OkStatus();
  if (!PlanCopy(seq->pages, seq->length, device, move))
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache full on ", names_[device], ": migration needs ", seq->pages.size(), " pages"));
  Pin(move);
  seq->state = SequenceState::kMigrating;
  return absl::OkStatus();
}

void SequenceTable::EndMigrate(const SequenceKey& key, const PageMove& move, bool ok) {
  if (move.from == move.to) return;
  Unpin(move);
  Sequence* seq = Find(key);
  seq->state = SequenceState::kIdle;
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
    if (index && seq->standby) {
      // A standby copy keeps its blocks' hashes and indexes them when promoted: until then its
      // pages are its primary's copy, not this replica's cache.
    } else if (index) {
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

// Tier moves: sequence_table_tiers.cc; the prefix cache: sequence_table_prefix.cc; the
// invariant checker: sequence_table_invariants.cc.

}  // namespace attnd
