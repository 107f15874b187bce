// Tenants (docs/trust.md): who owns a sequence or a step, what each may hold (quotas) and what each
// holds now. The anonymous tenant "" is the one tenant of an unauthenticated server.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace attnd {

// A sequence's name: the client's id inside its tenant's namespace ("" = the anonymous tenant).
// Another tenant's sequence of the same id is a different sequence.
struct SequenceKey {
  SequenceKey(std::string id) : id(std::move(id)) {}  // NOLINT: the anonymous tenant
  SequenceKey(const char* id) : id(id) {}             // NOLINT
  SequenceKey(std::string tenant, std::string id) : tenant(std::move(tenant)), id(std::move(id)) {}
  std::string tenant;
  std::string id;

  friend bool operator==(const SequenceKey& a, const SequenceKey& b) {
    return a.tenant == b.tenant && a.id == b.id;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SequenceKey& k) {
    return H::combine(std::move(h), k.tenant, k.id);
  }
};

// What a tenant may hold at once; 0 = no limit.
struct TenantQuota {
  int64_t pages = 0;        // cache pages of its sequences and open steps, every device
  int64_t sequences = 0;    // open sequences
  int64_t open_steps = 0;   // steps begun and not yet ended
  int64_t shm_regions = 0;  // registered shared-memory regions (the service counts these)
};

struct TenantUsage {
  int64_t pages = 0;
  int64_t sequences = 0;
  int64_t open_steps = 0;
};

// Not thread safe: the engine calls it under its lock.
class TenantLedger {
 public:
  // `fallback` applies to every tenant without an entry in `overrides`.
  void SetQuotas(TenantQuota fallback, absl::flat_hash_map<std::string, TenantQuota> overrides);
  const TenantQuota& QuotaOf(const std::string& tenant) const;
  TenantUsage UsageOf(const std::string& tenant) const;

  // RESOURCE_EXHAUSTED naming the quota unless the tenant may hold `more` more of it.
  absl::Status CheckPages(const std::string& tenant, int64_t more) const;
  absl::Status CheckSequences(const std::string& tenant, int64_t more) const;
  absl::Status CheckOpenSteps(const std::string& tenant, int64_t more) const;

  // Usage changes (negative to release). The caller checked the quota first.
  void AddPages(const std::string& tenant, int64_t delta);
  void AddSequences(const std::string& tenant, int64_t delta);
  void AddOpenSteps(const std::string& tenant, int64_t delta);

 private:
  TenantUsage& Usage(const std::string& tenant) { return usage_[tenant]; }
  void Forget(const std::string& tenant);  // drops an entry that holds nothing

  TenantQuota fallback_;
  absl::flat_hash_map<std::string, TenantQuota> overrides_;
  absl::flat_hash_map<std::string, TenantUsage> usage_;
};

}  // namespace attnd
