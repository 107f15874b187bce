// Leases (docs/replication.md#leases), the standby's side: a primary serves a sequence only while
// it holds a lease on the sequence's standby copy, renewed by every replication call that reaches
// the copy (its open, each write-only step, a lease check). The standby remembers, per copy, until
// when it granted one, measured from when the call arrived (never earlier than the primary sent
// it, so the grant outlasts the primary's lease), and does not promote the copy before then
// unless the primary itself hands the sequence over (a drain). Thread safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "kv_store/tenant_ledger.h"

namespace attnd {

class StandbyLeases {
 public:
  using Clock = std::chrono::steady_clock;
  // The most a primary may ask for (OpenSequenceRequest/BeginStepRequest/DescribeSequenceRequest
  // lease_ms): a grant outlives its primary by at most this.
  static constexpr int64_t kMaxLeaseMs = 600000;

  // A call for key's copy asked for a lease of `ms` (0: none), from now. False (nothing
  // granted: refuse the call) while the copy is being promoted.
  bool Grant(const SequenceKey& key, int64_t ms);
  // How long key's copy is still leased to its primary (zero: not leased, promote it).
  std::chrono::milliseconds Remaining(const SequenceKey& key) const;
  // Before promoting key's copy, atomically with the grants: zero, and from then on every Grant
  // for it refused until EndPromotion, when no lease runs (or `release`: its primary hands it
  // over itself); else the time left, and nothing changes.
  std::chrono::milliseconds BeginPromotion(const SequenceKey& key, bool release);
  // The promotion ended (done or failed), or the copy was closed: its grant ends.
  void EndPromotion(const SequenceKey& key) { Release(key); }
  void Release(const SequenceKey& key);
  int64_t size() const;

 private:
  struct Lease {
    Clock::time_point until;
    bool promoting = false;
  };
  void SweepLocked(Clock::time_point now);  // drops grants that ran out

  mutable std::mutex mu_;
  absl::flat_hash_map<SequenceKey, Lease> until_;
  Clock::time_point next_sweep_ = Clock::now();
};

}  // namespace attnd
