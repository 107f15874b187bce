// Which sequences spill first when a tier needs room (SequenceTable::Victims): a policy ranks
// the candidates, every one idle at that tier; the table then takes them in that order until
// enough slots would be freed. LRU today; another policy (by tenant priority, by size, by a
// router's hint) replaces it without touching the table (SequenceTable::SetEvictionPolicy).
#pragma once

#include <string_view>
#include <vector>

namespace attnd {

struct Sequence;

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;
  // Sorts `candidates`, the first to go first. Deterministic: ties are broken by key.
  virtual void Rank(std::vector<const Sequence*>& candidates) const = 0;
};

// Standby copies first (a copy is read only if its primary fails), then the least recently used
// (Sequence::last_used), ties by tenant and id.
class LruEviction final : public EvictionPolicy {
 public:
  std::string_view name() const override { return "lru"; }
  void Rank(std::vector<const Sequence*>& candidates) const override;
};

}  // namespace attnd
