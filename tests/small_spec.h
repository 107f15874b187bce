// The tiny model with small selection budgets (K 10, page_union 3 pages, page_budget 2), so
// kernel and selection tests reach every selection rule on short sequences.
#pragma once

#include "common/model_spec.h"

namespace attnd::testing {

inline ModelSpec SmallSpec(SelectionMode mode) {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.selection = mode;
  s.page_union_max_pages = 3;
  s.page_budget = 2;
  s.index_topk = 10;
  return s;
}

}  // namespace attnd::testing
