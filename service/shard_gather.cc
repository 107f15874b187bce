#include "service/shard_gather.h"

#include "absl/strings/str_cat.h"

namespace attnd {

std::map<uint64_t, ShardGather::Entry>::const_iterator ShardGather::Find(
    const StepRef& step) const {
  auto it = steps_.find(step.id);
  return it != steps_.end() && it->second.tenant == step.tenant ? it : steps_.end();
}

std::map<uint64_t, ShardGather::Entry>::iterator ShardGather::Find(const StepRef& step) {
  auto it = steps_.find(step.id);
  return it != steps_.end() && it->second.tenant == step.tenant ? it : steps_.end();
}

void ShardGather::Register(const StepRef& step, int num_shards) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = steps_[step.id];
  e.tenant = step.tenant;
  e.num_shards = num_shards;
  e.parts.assign(num_shards, std::nullopt);
}

int ShardGather::NumShards(const StepRef& step) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = Find(step);
  return it == steps_.end() ? 0 : it->second.num_shards;
}

absl::Status ShardGather::CheckJoin(const StepRef& step, int shard) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = Find(step);
  if (it == steps_.end())
    return absl::NotFoundError(absl::StrCat("step ", step.id, " is not an open sharded step"));
  if (shard < 1 || shard >= it->second.num_shards)
    return absl::InvalidArgumentError(
        absl::StrCat("join: shard ", shard, " outside [1, ", it->second.num_shards, ")"));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::vector<ShardGather::Part>>> ShardGather::Add(const StepRef& step,
                                                                               Part part) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = Find(step);
  if (it == steps_.end())
    return absl::NotFoundError(absl::StrCat("step ", step.id, " is not an open sharded step"));
  Entry& e = it->second;
  const int shard = part.in->shard();
  if (shard < 0 || shard >= e.num_shards)
    return absl::InvalidArgumentError(
        absl::StrCat("shard: ", shard, " outside [0, ", e.num_shards, ")"));
  if (e.parked > 0 && part.in->layer() != e.layer)
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " sent layer ",
                                                      part.in->layer(), " while layer ", e.layer,
                                                      " waits for other shards"));
  if (e.parts[shard])
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard, " already sent layer ", e.layer));
  if (e.parked == 0) {
    e.layer = part.in->layer();
    e.since = Clock::now();
  }
  e.parts[shard] = std::move(part);
  if (++e.parked < e.num_shards) return std::optional<std::vector<Part>>();
  std::vector<Part> all;
  for (auto& p : e.parts) {
    all.push_back(std::move(*p));
    p.reset();
  }
  e.parked = 0;
  return std::optional<std::vector<Part>>(std::move(all));
}

void ShardGather::Fail(const StepRef& step, const absl::Status& status) {
  std::vector<Part> parked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = Find(step);
    if (it == steps_.end()) return;
    for (auto& p : it->second.parts)
      if (p) parked.push_back(std::move(*p));
    steps_.erase(it);
  }
  for (Part& p : parked) p.done(status);  // outside the lock: done may start the next read
}

void ShardGather::Forget(const StepRef& step) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = Find(step);
  if (it != steps_.end()) steps_.erase(it);
}

std::vector<StepRef> ShardGather::Stale(Clock::duration idle) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StepRef> out;
  const auto now = Clock::now();
  for (const auto& [step, e] : steps_)
    if (e.parked > 0 && now - e.since > idle) out.push_back(StepRef(e.tenant, step));
  return out;
}

std::vector<StepRef> ShardGather::Steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StepRef> out;
  for (const auto& [step, e] : steps_) out.push_back(StepRef(e.tenant, step));
  return out;
}

}  // namespace attnd
