#include "cluster/standby_leases.h"

#include <algorithm>

namespace attnd {

bool StandbyLeases::Grant(const SequenceKey& key, int64_t ms) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = until_.find(key);
  if (it != until_.end() && it->second.promoting) return false;
  if (ms <= 0) return true;
  const auto until = now + std::chrono::milliseconds(std::min(ms, kMaxLeaseMs));
  if (it == until_.end()) {
    until_.emplace(key, Lease{until});
  } else {
    it->second.until = std::max(it->second.until, until);
  }
  if (now >= next_sweep_) SweepLocked(now);
  return true;
}

std::chrono::milliseconds StandbyLeases::Remaining(const SequenceKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = until_.find(key);
  const auto now = Clock::now();
  if (it == until_.end() || it->second.until <= now) return std::chrono::milliseconds(0);
  // Rounded up: a copy is never called free while any of its grant is left.
  return std::chrono::ceil<std::chrono::milliseconds>(it->second.until - now);
}

std::chrono::milliseconds StandbyLeases::BeginPromotion(const SequenceKey& key, bool release) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  Lease& l = until_[key];
  if (!release && l.until > now)
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::ceil<std::chrono::milliseconds>(l.until - now));
  l.promoting = true;
  return std::chrono::milliseconds(0);
}

void StandbyLeases::Release(const SequenceKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  until_.erase(key);
}

int64_t StandbyLeases::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(until_.size());
}

void StandbyLeases::SweepLocked(Clock::time_point now) {
  absl::erase_if(until_,
                 [&](const auto& kv) { return kv.second.until <= now && !kv.second.promoting; });
  next_sweep_ = now + std::chrono::seconds(1);
}

}  // namespace attnd
