#include "kv_store/tenant_ledger.h"

#include "absl/strings/str_cat.h"

namespace attnd {
namespace {

// `limit` 0 means none; the comparison cannot overflow (both are non-negative).
absl::Status Check(const char* quota, const char* flag, int64_t held, int64_t more, int64_t limit) {
  if (limit <= 0 || more <= limit - held) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("tenant quota ", quota, ": holds ", held, " of ",
                                                   limit, ", needs ", more, " more (", flag,
                                                   " or the token file's ", quota, "=)"));
}

}  // namespace

void TenantLedger::SetQuotas(TenantQuota fallback,
                             absl::flat_hash_map<std::string, TenantQuota> overrides) {
  fallback_ = fallback;
  overrides_ = std::move(overrides);
}

const TenantQuota& TenantLedger::QuotaOf(const std::string& tenant) const {
  auto it = overrides_.find(tenant);
  return it == overrides_.end() ? fallback_ : it->second;
}

TenantUsage TenantLedger::UsageOf(const std::string& tenant) const {
  auto it = usage_.find(tenant);
  return it == usage_.end() ? TenantUsage{} : it->second;
}

absl::Status TenantLedger::CheckPages(const std::string& tenant, int64_t more) const {
  return Check("pages", "--quota-pages", UsageOf(tenant).pages, more, QuotaOf(tenant).pages);
}

absl::Status TenantLedger::CheckSequences(const std::string& tenant, int64_t more) const {
  return Check("sequences", "--quota-sequences", UsageOf(tenant).sequences, more,
               QuotaOf(tenant).sequences);
}

absl::Status TenantLedger::CheckOpenSteps(const std::string& tenant, int64_t more) const {
  return Check("steps", "--quota-steps", UsageOf(tenant).open_steps, more,
               QuotaOf(tenant).open_steps);
}

void TenantLedger::AddPages(const std::string& tenant, int64_t delta) {
  Usage(tenant).pages += delta;
  Forget(tenant);
}

void TenantLedger::AddSequences(const std::string& tenant, int64_t delta) {
  Usage(tenant).sequences += delta;
  Forget(tenant);
}

void TenantLedger::AddOpenSteps(const std::string& tenant, int64_t delta) {
  Usage(tenant).open_steps += delta;
  Forget(tenant);
}

void TenantLedger::Forget(const std::string& tenant) {
  auto it = usage_.find(tenant);
  if (it != usage_.end() && it->second.pages == 0 && it->second.sequences == 0 &&
      it->second.open_steps == 0)
    usage_.erase(it);
}

}  // namespace attnd
