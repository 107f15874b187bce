#include "kv_store/eviction_policy.h"

#include <algorithm>
#include <functional>
#include <tuple>

#include "kv_store/sequence_table.h"

namespace attnd {

void LruEviction::Rank(std::vector<const Sequence*>& candidates) const {
  std::sort(candidates.begin(), candidates.end(), [](const Sequence* a, const Sequence* b) {
    return std::make_tuple(!a->standby, a->last_used, std::cref(a->tenant), std::cref(a->id)) <
           std::make_tuple(!b->standby, b->last_used, std::cref(b->tenant), std::cref(b->id));
  });
}

}  // namespace attnd
