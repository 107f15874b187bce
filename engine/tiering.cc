// The tiers below the devices (docs/architecture.md#tiers): spills and restores of sequences,
// room made on a device or the host tier, prefetch and offload, idle spills. The bookkeeping is
// the sequence table's (BeginTierMove / EndTierMove, under mu); the bytes move here with mu
// released, page by page as CacheLayout stages them, so a restored sequence holds the same
// bytes it had.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "common/guarded.h"
#include "common/status_macros.h"
#include "engine/engine_impl.h"

namespace attnd {
namespace {

using Clock = EngineClock;

// Pages staged at once by a move through host buffers (device <-> disk): bounds its memory.
constexpr size_t kStagedPages = 8;
// Disk transfers in flight at once (the caller and three workers).
constexpr int kDiskInFlight = 4;

// Aligned host buffers of whole pages (the disk tier writes them with O_DIRECT).
struct Staging {
  explicit Staging(size_t page_bytes, size_t pages)
      : stride(TierStride(page_bytes)),
        p(static_cast<uint8_t*>(std::aligned_alloc(kTierAlign, stride * pages))) {}
  ~Staging() { std::free(p); }
  uint8_t* at(size_t i) const { return p + i * stride; }
  size_t stride;
  uint8_t* p;
};

}  // namespace

const char* TierReasonName(TierEvent::Reason reason) {
  switch (reason) {
    case TierEvent::Reason::kStep:
      return "step";
    case TierEvent::Reason::kPrefetch:
      return "prefetch";
    case TierEvent::Reason::kOffload:
      return "offload";
    case TierEvent::Reason::kIdle:
      return "idle";
    case TierEvent::Reason::kRoom:
      return "room";
    case TierEvent::Reason::kUse:
      return "use";
  }
  return "?";
}

absl::Status Engine::Impl::CreateTiers(const CacheLayout& layout) {
  const TierOptions& t = options.tiers;
  const size_t page_bytes = layout.BytesPerPage();
  const int32_t host_slots =
      static_cast<int32_t>(std::min<size_t>(t.host_bytes / TierStride(page_bytes), INT32_MAX));
  const int32_t disk_slots = t.disk_dir.empty()
                                 ? 0
                                 : static_cast<int32_t>(std::min<size_t>(
                                       t.disk_bytes / TierStride(page_bytes), INT32_MAX));
  if (t.host_bytes > 0 && host_slots == 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "--host-cache-bytes ", t.host_bytes, ": less than one page (", page_bytes, " bytes)"));
  if (!t.disk_dir.empty() && disk_slots == 0)
    return absl::InvalidArgumentError(absl::StrCat("--disk-cache-bytes ", t.disk_bytes,
                                                   ": less than one page (", page_bytes,
                                                   " bytes); give the disk tier a size"));
  if (host_slots > 0) {
    ASSIGN_OR_RETURN(host, HostTier::Create(page_bytes, host_slots, HostTierAllocator(devices)));
  }
  if (disk_slots > 0) {
    ASSIGN_OR_RETURN(disk,
                     DiskTier::Create(t.disk_dir, t.disk_file, page_bytes, disk_slots, t.disk_io));
    disk_io = std::make_unique<ThreadPool>(kDiskInFlight);
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::CopyTierBytes(const TierMove& move, std::vector<int32_t>* lost) {
  if (move.pages.empty()) return absl::OkStatus();
  const CacheLayout& layout = devices[0]->layout();
  const size_t page_bytes = layout.BytesPerPage();
  Device* dev = move.device >= 0 ? devices[move.device].get() : nullptr;
  // Device <-> host: the device stages straight into or out of the host tier's slots.
  std::vector<int32_t> pages;
  std::vector<uint8_t*> to_host;
  std::vector<const uint8_t*> from_host;
  for (const TierMove::Page& p : move.pages) {
    if (p.from == Tier::kDevice && p.to == Tier::kHost) {
      pages.push_back(p.src);
      to_host.push_back(host->Slot(p.dst));
    }
  }
  if (!pages.empty()) RETURN_IF_ERROR(dev->ReadPages(pages, to_host));
  pages.clear();
  for (const TierMove::Page& p : move.pages) {
    if (p.from == Tier::kHost && p.to == Tier::kDevice) {
      pages.push_back(p.dst);
      from_host.push_back(host->Slot(p.src));
    }
  }
  if (!pages.empty()) RETURN_IF_ERROR(dev->WritePages(pages, from_host));
  // Host <-> disk: kDiskInFlight slots at a time.
  std::vector<const TierMove::Page*> host_disk;
  for (const TierMove::Page& p : move.pages)
    if ((p.from == Tier::kHost && p.to == Tier::kDisk) ||
        (p.from == Tier::kDisk && p.to == Tier::kHost))
      host_disk.push_back(&p);
  std::vector<absl::Status> done(host_disk.size());
  if (!host_disk.empty())
    disk_io->ParallelFor(static_cast<int64_t>(host_disk.size()), [&](int64_t i) {
      const TierMove::Page& p = *host_disk[i];
      done[i] = p.to == Tier::kDisk ? disk->Write(p.dst, host->Slot(p.src), host->stride())
                                    : disk->Read(p.src, host->Slot(p.dst), host->stride());
    });
  absl::Status first_loss = absl::OkStatus();
  for (size_t i = 0; i < host_disk.size(); ++i) {
    if (done[i].ok()) continue;
    if (done[i].code() != absl::StatusCode::kDataLoss) return done[i];
    lost->push_back(host_disk[i]->id);  // read on: every lost page is named at once
    if (first_loss.ok()) first_loss = done[i];
  }
  if (!first_loss.ok()) return first_loss;
  // Device <-> disk: through aligned staging, kStagedPages at a time, their disk transfers in
  // parallel.
  std::vector<const TierMove::Page*> down, up;
  for (const TierMove::Page& p : move.pages) {
    if (p.from == Tier::kDevice && p.to == Tier::kDisk) down.push_back(&p);
    if (p.from == Tier::kDisk && p.to == Tier::kDevice) up.push_back(&p);
  }
  if (down.empty() && up.empty()) return absl::OkStatus();
  Staging staging(page_bytes, kStagedPages);
  if (staging.p == nullptr) return absl::ResourceExhaustedError("tier move: no staging memory");
  std::vector<absl::Status> io(kStagedPages);
  for (size_t i = 0; i < down.size(); i += kStagedPages) {
    const size_t n = std::min(kStagedPages, down.size() - i);
    std::vector<int32_t> src(n);
    std::vector<uint8_t*> buf(n);
    for (size_t j = 0; j < n; ++j) src[j] = down[i + j]->src, buf[j] = staging.at(j);
    RETURN_IF_ERROR(dev->ReadPages(src, buf));
    disk_io->ParallelFor(static_cast<int64_t>(n), [&](int64_t j) {
      io[j] = disk->Write(down[i + j]->dst, buf[j], staging.stride);
    });
    for (size_t j = 0; j < n; ++j) RETURN_IF_ERROR(io[j]);
  }
  for (size_t i = 0; i < up.size(); i += kStagedPages) {
    const size_t n = std::min(kStagedPages, up.size() - i);
    disk_io->ParallelFor(static_cast<int64_t>(n), [&](int64_t j) {
      io[j] = disk->Read(up[i + j]->src, staging.at(j), staging.stride);
    });
    std::vector<int32_t> dst;
    std::vector<const uint8_t*> buf;
    for (size_t j = 0; j < n; ++j) {
      if (io[j].ok()) {
        dst.push_back(up[i + j]->dst);
        buf.push_back(staging.at(j));
        continue;
      }
      if (io[j].code() != absl::StatusCode::kDataLoss) return io[j];
      lost->push_back(up[i + j]->id);  // read on: every lost page is named at once
      if (first_loss.ok()) first_loss = io[j];
    }
    if (!dst.empty()) RETURN_IF_ERROR(dev->WritePages(dst, buf));
  }
  return first_loss;
}

absl::Status Engine::Impl::RunTierMove(EngineLock& lock, const TierMove& move,
                                       TierEvent::Reason reason) {
  std::vector<int32_t> lost;
  absl::Status copied = absl::OkStatus();
  TierEvent ev;
  // Up (to a faster tier) is a restore; pages-only moves go down.
  ev.kind = move.to < move.from ? TierEvent::Kind::kRestore : TierEvent::Kind::kSpill;
  ev.reason = reason;
  ev.from = move.from;
  ev.to = move.to;
  ev.tenant = move.key.tenant;
  ev.sequence = move.key.id;
  ev.pages = static_cast<int64_t>(move.pages.size());
  ev.bytes = ev.pages * static_cast<int64_t>(devices[0]->layout().BytesPerPage());
  if (!move.pages.empty()) {
    ++moves_in_flight;
    lock.unlock();
    const auto t0 = Clock::now();
    copied = Guarded([&] { return CopyTierBytes(move, &lost); });
    ev.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (copied.ok()) Emit(ev);
    lock.lock();
    --moves_in_flight;
  }
  const std::vector<SequenceKey> lost_seqs = table->EndTierMove(move, copied.ok(), lost);
  step_ended.notify_all();
  if (copied.ok()) {
    for (const TierMove::Page& p : move.pages)
      counters.tier_bytes[static_cast<int>(p.from)][static_cast<int>(p.to)] +=
          static_cast<int64_t>(devices[0]->layout().BytesPerPage());
    if (!move.key.id.empty() && move.from != move.to) {
      if (ev.kind == TierEvent::Kind::kSpill) {
        ++counters.spills;
      } else if (reason == TierEvent::Reason::kStep) {
        ++counters.restores_step;
      } else if (reason == TierEvent::Reason::kPrefetch) {
        ++counters.restores_prefetch;
      } else {
        ++counters.restores_other;
      }
    }
  }
  if (!lost_seqs.empty()) {
    counters.data_loss += static_cast<int64_t>(lost_seqs.size());
    lock.unlock();
    for (const SequenceKey& k : lost_seqs) {
      TierEvent loss;
      loss.kind = TierEvent::Kind::kDataLoss;
      loss.reason = reason;
      loss.from = Tier::kDisk;
      loss.tenant = k.tenant;
      loss.sequence = k.id;
      loss.detail = std::string(copied.message());
      Emit(loss);
    }
    lock.lock();
    // The client hears which sequence was lost, not the server's file and slot (logged).
    if (copied.code() == absl::StatusCode::kDataLoss && !move.key.id.empty())
      if (const Sequence* seq = table->Find(move.key); seq != nullptr && seq->lost())
        return table->OnDevice(*seq);
  }
  return copied;
}

absl::Status Engine::Impl::MoveLocked(EngineLock& lock, const SequenceKey& key, Tier to,
                                      TierEvent::Reason reason) {
  TierMove move;
  RETURN_IF_ERROR(table->BeginTierMove(key, to, &move));
  return RunTierMove(lock, move, reason);
}

std::string Engine::Impl::TierUse() const {
  std::string out;
  for (int d = 0; d < static_cast<int>(devices.size()); ++d)
    absl::StrAppend(&out, d ? ", " : "", devices[d]->name(), " ", table->pool(d).used_pages(), "/",
                    table->pool(d).usable_pages());
  absl::StrAppend(
      &out, "; host tier ",
      host ? absl::StrCat(table->host_slots().used_slots(), "/", table->host_slots().slots())
           : std::string("off"),
      "; disk tier ",
      disk ? absl::StrCat(table->disk_slots().used_slots(), "/", table->disk_slots().slots())
           : std::string("off"),
      " pages used");
  return out;
}

bool Engine::Impl::AwaitSettled(EngineLock& lock, const SequenceKey& key) {
  const auto deadline = Clock::now() + options.limits.abort_wait;
  while (!table->Settled(key))
    if (step_ended.wait_until(lock, deadline) == std::cv_status::timeout) return false;
  return true;
}

absl::Status Engine::Impl::AwaitSettledOrSay(EngineLock& lock, const SequenceKey& key) {
  if (AwaitSettled(lock, key)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "sequence ", Quote(key.id),
      " (or a sequence it shares pages with) is still moving between tiers or being read after "
      "--begin-wait-ms"));
}

absl::Status Engine::Impl::LiftForRead(EngineLock& lock, const SequenceKey& key) {
  for (int round = 0; round < 64; ++round) {
    RETURN_IF_ERROR(AwaitSettledOrSay(lock, key));
    const Sequence* seq = table->Find(key);
    if (seq == nullptr) return table->NotFound(key);
    if (seq->lost()) return table->OnDevice(*seq);  // DATA_LOSS
    if (seq->tier != Tier::kDisk) return absl::OkStatus();
    if (host == nullptr) return RestoreLocked(lock, key, TierEvent::Reason::kUse);
    const int32_t need = table->MoveNeeds(key, Tier::kHost)[static_cast<int>(Tier::kHost)];
    if (!MakeHostRoom(lock, need).ok()) return RestoreLocked(lock, key, TierEvent::Reason::kUse);
    // Making room let go of the lock: a step or a prefetch may have brought it up meanwhile
    // (a sequence in use is never sent down for a read), or it may be busy: look again.
    seq = table->Find(key);
    if (seq == nullptr || seq->tier != Tier::kDisk || !table->Settled(key)) continue;
    const absl::Status moved = MoveLocked(lock, key, Tier::kHost, TierEvent::Reason::kUse);
    // Up, or room taken meanwhile, or busy again: look again (a page it shares may have begun
    // moving while its bytes were copied; the next round waits for that).
    if (moved.ok() || moved.code() == absl::StatusCode::kResourceExhausted ||
        moved.code() == absl::StatusCode::kFailedPrecondition)
      continue;
    return moved;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("sequence ", Quote(key.id), ": no room could be kept for it on the host tier (",
                   TierUse(), ")"));
}

absl::Status Engine::Impl::ReadTierRows(int device, int layer, const std::vector<TierPin>& pins,
                                        int64_t begin, int64_t end, LayerRowBytes* out) const {
  Device& dev = *devices[device];
  const int slot = spec().FullSlot(layer);
  return ReadLayerRows(
      dev.layout(), spec(), layer, begin, end,
      [&](size_t i, int first, int rows, uint8_t* latent, uint8_t* index) -> absl::Status {
        const TierPin& pin = pins[i];
        if (pin.tier == Tier::kDevice)  // shared with a sequence on the device
          return dev.ReadRows(layer, slot, pin.slot, first, rows, latent, index);
        if (pin.tier != Tier::kHost || host == nullptr)  // LiftForRead brought it up
          return absl::InternalError("an exported page is on the disk tier");
        dev.layout().StagedPageRows(host->Slot(pin.slot), layer, slot, first, rows, latent, index);
        return absl::OkStatus();
      },
      out);
}

absl::Status Engine::Impl::MakeHostRoom(EngineLock& lock, int32_t need) {
  for (int round = 0; round < 256; ++round) {
    // Without a disk tier the prefix cache's host pages make way (MakeFree frees them at the
    // cache's own tier only).
    if (table->MakeFree(Tier::kHost, -1, need)) return absl::OkStatus();
    const int32_t free = table->host_slots().free_slots();
    if (disk == nullptr) break;
    if (table->Orphans(Tier::kHost, -1) > 0) {
      TierMove m;
      table->BeginOrphanMove(Tier::kHost, -1, need - free, &m);
      if (!m.pages.empty()) {
        RETURN_IF_ERROR(RunTierMove(lock, m, TierEvent::Reason::kRoom));
        continue;
      }
    }
    const std::vector<SequenceKey> victims = table->Victims(Tier::kHost, -1, need - free);
    if (victims.empty()) break;
    RETURN_IF_ERROR(MoveLocked(lock, victims[0], Tier::kDisk, TierEvent::Reason::kRoom));
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("host tier full: ", need, " pages needed, ", table->host_slots().free_slots(),
                   " free, nothing left to move to disk (", TierUse(), ")"));
}

absl::Status Engine::Impl::SpillLocked(EngineLock& lock, const SequenceKey& key,
                                       TierEvent::Reason reason) {
  if (!tiers_on())
    return absl::FailedPreconditionError(
        "no tier below the device (--host-cache-bytes, --disk-cache-dir)");
  if (host != nullptr) {
    const int32_t want = table->MoveNeeds(key, Tier::kHost)[static_cast<int>(Tier::kHost)];
    const absl::Status room = MakeHostRoom(lock, want);
    if (room.ok()) {
      const absl::Status moved = MoveLocked(lock, key, Tier::kHost, reason);
      if (moved.code() != absl::StatusCode::kResourceExhausted || disk == nullptr) return moved;
    } else if (disk == nullptr) {
      return room;
    }
  }
  return MoveLocked(lock, key, Tier::kDisk, reason);
}

absl::Status Engine::Impl::MakeRoom(EngineLock& lock, int device, int32_t need,
                                    const std::vector<const Sequence*>& keep) {
  absl::Status last = absl::OkStatus();
  // What holds the device's pages may be busy for a moment (in a step, read by an export, moving):
  // wait for a change, within --begin-wait-ms, before saying nothing can spill.
  const auto deadline = Clock::now() + options.limits.abort_wait;
  for (int round = 0; round < 256; ++round) {
    const int32_t free = table->pool(device).free_pages();
    if (free >= need) return absl::OkStatus();
    if (table->Orphans(Tier::kDevice, device) > 0) {
      if (host != nullptr) (void)MakeHostRoom(lock, need - free);
      TierMove m;
      table->BeginOrphanMove(Tier::kDevice, device, need - free, &m);
      if (!m.pages.empty()) {
        RETURN_IF_ERROR(RunTierMove(lock, m, TierEvent::Reason::kRoom));
        continue;
      }
    }
    const std::vector<SequenceKey> victims =
        table->Victims(Tier::kDevice, device, need - free, keep);
    // Nothing to spill and the prefix cache's pages here cannot go down: they make way.
    if (victims.empty() &&
        table->EvictCached(static_cast<int>(Tier::kDevice), device, need - free) > 0)
      continue;
    if (victims.empty()) {
      // Only when something busy may let go of pages: a step, a read, a copy or a move.
      const bool busy = !steps.empty() || table->pins() > 0 || moves_in_flight > 0;
      if (need > table->pool(device).usable_pages() || !busy ||
          step_ended.wait_until(lock, deadline) == std::cv_status::timeout)
        break;
      continue;
    }
    last = SpillLocked(lock, victims[0], TierEvent::Reason::kRoom);
    // Spilled, or the victim was closed while the host made room (a drain hands sequences off
    // and closes them): look again.
    if (last.ok() || last.code() == absl::StatusCode::kNotFound) continue;
    // Another request took that victim first (it is moving now): look again once it moved.
    if (last.code() == absl::StatusCode::kFailedPrecondition &&
        step_ended.wait_until(lock, deadline) == std::cv_status::no_timeout)
      continue;
    break;
  }
  if (table->pool(device).free_pages() >= need) return absl::OkStatus();  // freed meanwhile
  return absl::ResourceExhaustedError(absl::StrCat(
      "KV cache full on ", devices[device]->name(), ": ", need, " pages needed, ",
      table->pool(device).free_pages(), " free, and no sequence can spill",
      last.ok() ? std::string() : absl::StrCat(" (", last.message(), ")"), " (", TierUse(), ")"));
}

absl::Status Engine::Impl::RestoreLocked(EngineLock& lock, const SequenceKey& key,
                                         TierEvent::Reason reason,
                                         const std::vector<const Sequence*>& keep) {
  for (int round = 0; round < 64; ++round) {
    RETURN_IF_ERROR(AwaitSettledOrSay(lock, key));
    Sequence* seq = table->Find(key);
    if (seq == nullptr) return table->NotFound(key);
    if (seq->lost()) return table->OnDevice(*seq);  // DATA_LOSS, said once for every use
    if (seq->tier == Tier::kDevice) return absl::OkStatus();
    std::vector<const Sequence*> stay = keep;
    stay.push_back(seq);
    const int32_t need = table->MoveNeeds(key, Tier::kDevice)[0];
    RETURN_IF_ERROR(MakeRoom(lock, seq->device, need, stay));
    const absl::Status moved = MoveLocked(lock, key, Tier::kDevice, reason);
    // Room taken meanwhile, or the sequence itself moved on (another request's spill made room
    // on the host by sending it to disk): look again (AwaitSettled waits for that move).
    if (moved.code() == absl::StatusCode::kResourceExhausted ||
        moved.code() == absl::StatusCode::kFailedPrecondition)
      continue;
    RETURN_IF_ERROR(moved);
    if (Sequence* s = table->Find(key)) s->last_used = Clock::now();
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat("sequence ", Quote(key.id),
                                                   ": no room could be kept for it on its device (",
                                                   TierUse(), ")"));
}

void Engine::Impl::PrefetchLoop() {
  EngineLock lock(mu);
  for (;;) {
    prefetch_wake.wait(lock, [&] { return stopping || !prefetch_queue.empty(); });
    if (stopping) return;
    const SequenceKey key = prefetch_queue.front();
    prefetch_queue.pop_front();
    prefetch_queued.erase(key);
    const Sequence* s = table->Find(key);
    if (s != nullptr && !s->lost() && s->tier != Tier::kDevice && s->step == 0) {
      prefetching = true;
      (void)RestoreLocked(lock, key, TierEvent::Reason::kPrefetch);
      prefetching = false;
    }
    step_ended.notify_all();  // WaitForPrefetches
  }
}

void Engine::WaitForPrefetches() {
  EngineLock lock(impl_->mu);
  impl_->step_ended.wait(lock, [&] {
    return impl_->stopping || (impl_->prefetch_queue.empty() && !impl_->prefetching);
  });
}

// ---- the API ----

std::vector<TierCapacity> Engine::Tiers() const {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  const size_t page = impl_->devices[0]->layout().BytesPerPage();
  auto capacity = [&](Tier tier, bool enabled, const SlotPool& slots) {
    TierCapacity c;
    c.tier = tier;
    c.enabled = enabled;
    c.pages_total = slots.slots();
    c.pages_used = slots.used_slots();
    c.bytes_per_page = page;
    c.sequences = impl_->table->sequences_at(tier);
    return c;
  };
  TierCapacity h = capacity(Tier::kHost, impl_->host != nullptr, impl_->table->host_slots());
  TierCapacity d = capacity(Tier::kDisk, impl_->disk != nullptr, impl_->table->disk_slots());
  if (impl_->disk) {
    d.where = impl_->disk->path();
    d.direct = impl_->disk->direct();
  }
  return {h, d};
}

void Engine::PrefetchSequences(const std::vector<SequenceKey>& seqs) {
  std::lock_guard<EngineMutex> lock(impl_->mu);
  if (!impl_->tiers_on()) return;
  // Only sequences that are below their devices, once each: the queue never holds more than the
  // table does, whatever clients send.
  for (const SequenceKey& k : seqs) {
    const Sequence* s = impl_->table->Find(k);
    if (s == nullptr || s->lost() || s->tier == Tier::kDevice) continue;
    if (impl_->prefetch_queued.insert(k).second) impl_->prefetch_queue.push_back(k);
  }
  impl_->prefetch_wake.notify_one();
}

absl::Status Engine::OffloadSequences(const std::vector<SequenceKey>& seqs) {
  EngineLock lock(impl_->mu);
  // An unknown id refuses the request before anything moves.
  for (const SequenceKey& k : seqs)
    if (impl_->table->Find(k) == nullptr) return impl_->table->NotFound(k);
  for (const SequenceKey& k : seqs) {
    RETURN_IF_ERROR(impl_->AwaitSettledOrSay(lock, k));
    const Sequence* s = impl_->table->Find(k);
    if (s == nullptr) return impl_->table->NotFound(k);
    if (s->tier != Tier::kDevice && !s->lost()) continue;  // down already
    RETURN_IF_ERROR(impl_->SpillLocked(lock, k, TierEvent::Reason::kOffload));
  }
  return absl::OkStatus();
}

int Engine::SpillIdleSequences(std::chrono::steady_clock::duration idle) {
  EngineLock lock(impl_->mu);
  if (!impl_->tiers_on()) return 0;
  const auto now = Clock::now();
  std::vector<SequenceKey> idle_ones;
  for (const Sequence* s : impl_->table->List(nullptr))
    if (s->tier == Tier::kDevice && s->idle() && !s->logical.empty() && now - s->last_used > idle)
      idle_ones.emplace_back(s->tenant, s->id);
  int moved = 0;
  for (const SequenceKey& k : idle_ones) {
    const Sequence* s = impl_->table->Find(k);
    if (s == nullptr || s->tier != Tier::kDevice || s->step != 0 || s->moving()) continue;
    moved += impl_->SpillLocked(lock, k, TierEvent::Reason::kIdle).ok() ? 1 : 0;
  }
  return moved;
}

}  // namespace attnd
